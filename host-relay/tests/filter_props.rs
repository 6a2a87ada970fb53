//! Property tests of the dovecot-auth filter and its connection handling:
//! - guest-to-service output equals the input minus exactly the stripped fields, plus the
//!   rip rewrite, however the input is cut into reads;
//! - service-to-guest bytes are identical, and a chunk written at once is read at once;
//! - the filter never panics on arbitrary input.

use std::net::IpAddr;

use host_relay::dovecot::{GuestFilter, Policy, RipRule, DEFAULT_ALLOW_FIELDS};
use proptest::prelude::*;
use vm_transport::Conn;

const APP: &str = "100.64.0.7";

fn policy(rule: RipRule) -> Policy {
    Policy {
        gateways: vec!["10.0.2.2".parse().unwrap(), "fd00::2".parse().unwrap()],
        reserved: vec!["100.64.0.0/10".parse().unwrap()],
        rip: rule,
        allow: DEFAULT_ALLOW_FIELDS.iter().map(|s| s.to_string()).collect(),
    }
}

/// One generated parameter and what the filter must make of it.
#[derive(Clone, Debug)]
enum Param {
    /// Allowed, not rip: kept as is.
    Kept(String),
    /// A trust field or unknown key: removed.
    Stripped(String),
    /// A rip naming a real client: kept as is.
    ClientRip(String),
    /// The app's own address: kept under substitute; under drop it is a reserved address.
    OwnRip(String),
    /// A rip that is a gateway, another app's address, or unparsable: rewritten.
    NotAClient(String),
}

fn value() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            4 => "[a-zA-Z0-9+/=._@-]".prop_map(|s| s),
            1 => "\x01[01trn]".prop_map(|s| s),
        ],
        0..12,
    )
    .prop_map(|v| v.concat())
}

fn param() -> impl Strategy<Value = Param> {
    let kept = (
        prop::sample::select(vec![
            "service",
            "lip",
            "lport",
            "rport",
            "local_name",
            "session",
            "client_id",
        ]),
        value(),
    )
        .prop_map(|(k, v)| Param::Kept(format!("{k}={v}")));
    let flag_kept = Just(Param::Kept("final-resp-ok".into()));
    let stripped = prop_oneof![
        prop::sample::select(vec![
            "no-penalty",
            "secured",
            "secured=tls",
            "valid-client-cert",
            "debug",
            "forward_fields=a",
            "real_rip=10.0.2.2",
            "real_lip=1.2.3.4",
            "real_lport=1",
            "real_rport=2",
            "cert_username=root",
        ])
        .prop_map(|s| Param::Stripped(s.to_string())),
        ("[a-z_-]{1,10}", value())
            .prop_filter("not an allowed key", |(k, _)| {
                !DEFAULT_ALLOW_FIELDS.contains(&k.as_str()) && k != "resp"
            })
            .prop_map(|(k, v)| Param::Stripped(format!("{k}={v}"))),
    ];
    let client = prop_oneof![
        (1u8..=9, any::<u8>(), any::<u8>(), 1u8..=254)
            .prop_map(|(a, b, c, d)| format!("{a}.{b}.{c}.{d}")),
        Just("2001:db8::1".to_string()),
    ]
    .prop_map(|ip| Param::ClientRip(format!("rip={ip}")));
    let own = Just(Param::OwnRip(format!("rip={APP}")));
    let not_client = prop_oneof![
        Just("10.0.2.2".to_string()),
        Just("fd00::2".to_string()),
        Just("::ffff:10.0.2.2".to_string()),
        (0u8..=63, any::<u8>()).prop_map(|(b, c)| format!("100.{}.{b}.{c}", 64 + b)),
        value().prop_filter("not an address", |v| v.parse::<IpAddr>().is_err()),
    ]
    .prop_map(|v| Param::NotAClient(format!("rip={v}")));
    prop_oneof![4 => kept, 1 => flag_kept, 3 => stripped, 1 => client, 1 => own, 2 => not_client]
}

fn auth_line() -> impl Strategy<Value = (String, Vec<Param>, Option<String>)> {
    (
        "[0-9]{1,5}",
        prop::collection::vec(param(), 0..8),
        prop::option::of("[A-Za-z0-9+/=]{0,40}"),
    )
        .prop_map(|(id, params, resp)| (format!("AUTH\t{id}\tPLAIN"), params, resp))
}

/// What the filter must produce, built from the generator's labels.
fn expected(head: &str, params: &[Param], resp: &Option<String>, rule: RipRule) -> String {
    let mut out = vec![head.to_string()];
    let mut have_rip = false;
    for p in params {
        match (p, rule) {
            (Param::Kept(f), _) => out.push(f.clone()),
            (Param::Stripped(_), _) => {}
            (Param::ClientRip(f), _) => {
                have_rip = true;
                out.push(f.clone());
            }
            (Param::OwnRip(f), RipRule::Substitute(_)) => {
                have_rip = true;
                out.push(f.clone());
            }
            (Param::OwnRip(_), RipRule::Drop) => {}
            (Param::NotAClient(_), RipRule::Substitute(a)) => {
                have_rip = true;
                out.push(format!("rip={a}"));
            }
            (Param::NotAClient(_), RipRule::Drop) => {}
        }
    }
    if let (false, RipRule::Substitute(a)) = (have_rip, rule) {
        out.push(format!("rip={a}"));
    }
    if let Some(r) = resp {
        out.push(format!("resp={r}"));
    }
    out.join("\t") + "\n"
}

fn input(head: &str, params: &[Param], resp: &Option<String>) -> String {
    let mut fields = vec![head.to_string()];
    for p in params {
        let (Param::Kept(f)
        | Param::Stripped(f)
        | Param::ClientRip(f)
        | Param::OwnRip(f)
        | Param::NotAClient(f)) = p;
        fields.push(f.clone());
    }
    if let Some(r) = resp {
        fields.push(format!("resp={r}"));
    }
    fields.join("\t") + "\n"
}

/// Feeds `data` cut at `cuts` (positions modulo the length) and returns the output.
fn feed_in_pieces(
    p: &Policy,
    data: &[u8],
    cuts: &[usize],
) -> Result<Vec<u8>, host_relay::dovecot::FilterError> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (data.len() + 1)).collect();
    points.push(0);
    points.push(data.len());
    points.sort_unstable();
    let mut f = GuestFilter::new(p);
    let mut out = Vec::new();
    for w in points.windows(2) {
        f.feed(&data[w[0]..w[1]], &mut out)?;
    }
    Ok(out)
}

proptest! {
    // 256 cases by default; PROPTEST_CASES overrides (the mutation run uses fewer).
    #![proptest_config(ProptestConfig::default())]

    #[test]
    fn output_is_input_minus_stripped_fields_plus_rip_rewrite(
        lines in prop::collection::vec(auth_line(), 1..5),
        cuts in prop::collection::vec(any::<usize>(), 0..6),
        substitute in any::<bool>(),
    ) {
        let rule = if substitute { RipRule::Substitute(APP.parse().unwrap()) } else { RipRule::Drop };
        let p = policy(rule);
        let data: String = lines.iter().map(|(h, ps, r)| input(h, ps, r)).collect();
        let want: String = lines.iter().map(|(h, ps, r)| expected(h, ps, r, rule)).collect();
        let got = feed_in_pieces(&p, data.as_bytes(), &cuts).unwrap();
        prop_assert_eq!(String::from_utf8(got).unwrap(), want);
    }

    #[test]
    fn other_lines_pass_byte_for_byte(
        lines in prop::collection::vec(("[A-Z]{1,8}", prop::collection::vec(value(), 0..5)), 1..6),
        cuts in prop::collection::vec(any::<usize>(), 0..6),
    ) {
        let data: String = lines
            .iter()
            .filter(|(cmd, _)| cmd != "AUTH")
            .map(|(cmd, fields)| {
                let mut l = cmd.clone();
                for f in fields { l.push('\t'); l.push_str(f); }
                l + "\n"
            })
            .collect();
        let p = policy(RipRule::Substitute(APP.parse().unwrap()));
        let got = feed_in_pieces(&p, data.as_bytes(), &cuts).unwrap();
        prop_assert_eq!(got, data.into_bytes());
    }

    #[test]
    fn never_panics_and_emits_only_whole_lines(
        data in prop::collection::vec(any::<u8>(), 0..20_000),
        cuts in prop::collection::vec(any::<usize>(), 0..8),
    ) {
        let p = policy(RipRule::Substitute(APP.parse().unwrap()));
        if let Ok(out) = feed_in_pieces(&p, &data, &cuts) {
            prop_assert!(out.is_empty() || out.ends_with(b"\n"));
            // Whatever passed has no raw NUL or CR, and every line fits Dovecot's limit.
            prop_assert!(!out.contains(&0) && !out.contains(&b'\r'));
            prop_assert!(out.split(|&b| b == b'\n').all(|l| l.len() < host_relay::dovecot::MAX_LINE + 64));
        }
    }
}

/// Everything `conn` receives until its end of stream.
async fn read_to_end(conn: &Conn) -> Vec<u8> {
    let mut got = Vec::new();
    while let Some(chunk) = conn.read_pooled().await.unwrap() {
        got.extend_from_slice(&chunk);
    }
    got
}

async fn pair() -> (Conn, Conn) {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    (
        Conn::from_std_unix(a).unwrap(),
        Conn::from_std_unix(b).unwrap(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn service_to_guest_bytes_are_identical(
        chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..3000), 0..20),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let got = rt.block_on(async {
            let (guest, guest_relay) = pair().await;
            let (service_relay, service) = pair().await;
            let p = policy(RipRule::Drop);
            let session = host_relay::serve::dovecot_session(&guest_relay, &service_relay, &p);
            let drive = async {
                for c in &chunks {
                    service.write_all(c).await.unwrap();
                }
                drop(service);
                guest.shutdown_write().unwrap();
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let n = guest.read(&mut buf).await.unwrap();
                    if n == 0 { break got; }
                    got.extend_from_slice(&buf[..n]);
                }
            };
            let (r, got) = tokio::join!(session, drive);
            r.unwrap();
            got
        });
        prop_assert_eq!(got, chunks.concat());
    }
}

#[tokio::test]
async fn a_greeting_written_at_once_is_read_at_once() {
    // Record sockets on both sides: a line the relay wrote in two calls would be seen
    // as two reads (stream reads would coalesce them).
    let (guest, guest_relay) = Conn::seqpacket_pair().unwrap();
    let (service_relay, service) = Conn::seqpacket_pair().unwrap();
    let p = policy(RipRule::Drop);
    tokio::spawn(async move {
        let _ = host_relay::serve::dovecot_session(&guest_relay, &service_relay, &p).await;
    });
    let greeting = b"VERSION\t1\t2\nMECH\tPLAIN\tplaintext\nMECH\tLOGIN\tplaintext\nSPID\t10806\nCUID\t1\nCOOKIE\t0123456789abcdef0123456789abcdef\nDONE\n";
    service.write_all(greeting).await.unwrap();
    let mut buf = [0u8; 1024];
    let n = guest.read(&mut buf).await.unwrap();
    assert_eq!(&buf[..n], greeting);
    // A reply line, too.
    service.write_all(b"OK\t1\tuser=alice\n").await.unwrap();
    let n = guest.read(&mut buf).await.unwrap();
    assert_eq!(&buf[..n], b"OK\t1\tuser=alice\n");
    // Guest to service: two whole lines written at once leave the filter as written.
    let lines = b"VERSION\t1\t1\nCPID\t9\n";
    guest.write_all(lines).await.unwrap();
    let n = service.read(&mut buf).await.unwrap();
    assert_eq!(&buf[..n], lines);
}

#[tokio::test]
async fn a_bad_line_closes_the_connection_and_nothing_of_it_is_sent() {
    let (guest, guest_relay) = pair().await;
    let (service_relay, service) = pair().await;
    let p = policy(RipRule::Drop);
    let session = tokio::spawn(async move {
        host_relay::serve::dovecot_session(&guest_relay, &service_relay, &p).await
    });
    guest
        .write_all(b"VERSION\t1\t2\nAUTH\t1\tPLAIN\tservice=x\x01q\tresp=AA==\n")
        .await
        .unwrap();
    let r = session.await.unwrap();
    assert!(r.is_err());
    // The service got the good line, then end of stream; nothing of the bad line.
    assert_eq!(read_to_end(&service).await, b"VERSION\t1\t2\n");
    // And the guest's side is closed.
    assert_eq!(guest.read(&mut [0u8; 16]).await.unwrap(), 0);
}

/// A guest that closed its socket entirely after its request is closed through to the
/// service at once (a half-close and a later close would be two wake-ups of Dovecot and
/// the relay): the moment the service reads the end, a reply already fails with `EPIPE`.
#[tokio::test]
async fn a_guest_that_closed_entirely_is_closed_through_at_once() {
    use std::os::fd::AsRawFd;

    let (guest, guest_relay) = pair().await;
    let (service_relay, service) = pair().await;
    let p = policy(RipRule::Drop);
    let session = tokio::spawn(async move {
        host_relay::serve::dovecot_session(&guest_relay, &service_relay, &p).await
    });
    guest.write_all(b"VERSION\t1\t2\nCPID\t9\n").await.unwrap();
    drop(guest);
    assert_eq!(read_to_end(&service).await, b"VERSION\t1\t2\nCPID\t9\n");
    // No await between the end and this send: on this single-threaded runtime the
    // session cannot close its socket in between.
    let reply = nix::sys::socket::send(
        service.as_raw_fd(),
        b"OK\t1\n",
        nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
    );
    assert_eq!(
        reply,
        Err(nix::errno::Errno::EPIPE),
        "the session half-closed the service for a guest that had gone entirely"
    );
    session.await.unwrap().unwrap();
}
