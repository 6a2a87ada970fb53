//! The pinned management CA and the guest clock, through the real `guest-init enroll` and
//! the real relay.
//!
//! - A second CA answering on the enrollment port: a second reference service (its own CA,
//!   even the same CA name) takes over the socket the relay connects to and issues a
//!   certificate for the guest's own key and identity. The guest refuses it with a final
//!   error naming the issuer, publishes nothing, and keeps its pending CSR, which the real
//!   service then certifies.
//! - A guest clock 10 minutes off, either way, enrolls; 20 minutes behind is refused with
//!   an error that blames the clock. The clock is shifted for the real guest-init process
//!   by libfaketime (`LD_PRELOAD`, `FAKETIME`), which replaces the `clock_gettime` the
//!   host build of guest-init calls through glibc; the service keeps the true time.

use super::*;
use e2e::util::require;

/// libfaketime's preload library (Debian package `libfaketime`), if installed.
fn libfaketime() -> Option<PathBuf> {
    ["x86_64-linux-gnu", "aarch64-linux-gnu"]
        .iter()
        .map(|t| PathBuf::from(format!("/usr/lib/{t}/faketime/libfaketime.so.1")))
        .find(|p| p.exists())
}

/// Runs `guest-init enroll` with its clock shifted by `offset` (libfaketime syntax, e.g.
/// `-10m`). Returns the exit code and output.
fn run_guest_at(env: &mut Env, lib: &Path, offset: &str) -> (i32, String) {
    let mut c = env.guest();
    c.env("LD_PRELOAD", lib)
        .env("FAKETIME", offset)
        // Only the wall clock moves; timers keep the true monotonic clock.
        .env("DONT_FAKE_MONOTONIC", "1");
    env.run(c)
}

fn nothing_enrolled(env: &Env) {
    assert!(
        !env.publish().join("cert.pem").exists(),
        "a certificate was published"
    );
    assert!(
        !env.state().join("enrolled.json").exists(),
        "a certificate was recorded as enrolled"
    );
    assert!(
        env.files_with(".crt").is_empty(),
        "a certificate was stored"
    );
}

fn issuer_of(der: &[u8]) -> String {
    let (_, c) = X509Certificate::from_der(der).unwrap();
    c.issuer().to_string()
}

#[test]
fn a_second_ca_on_the_enrollment_port_is_refused_and_nothing_is_published() {
    let mut env = Env::new(&[VM], VM);
    let id = identity(VM, 4);
    let token = env.provision(&id);

    // The rogue: its own CA (same name as the real one, so only the signature tells them
    // apart), the same token registered, answering where the relay connects.
    let rogue = EnrollService::start().unwrap();
    rogue
        .register(&token, &id, Duration::from_secs(600))
        .unwrap();
    let upstream = env.path(&format!("svc-{VM}.sock"));
    rogue.listen_vm(VM, &upstream).unwrap();

    let (code, out) = env.run_guest();
    assert_eq!(
        code, 3,
        "a rogue CA's certificate must be a final error: {out}"
    );
    assert!(
        out.contains("final failure")
            && out.contains("not issued by the pinned management CA")
            && out.contains("names the issuer CN=reference enrollment CA")
            && out.contains("does not verify under the pinned CA's key"),
        "the refusal must name the issuer and why: {out}"
    );
    // The rogue did answer with a certificate for our key and identity: the pin alone
    // stopped it.
    let rogue_cert = rogue.committed_cert(&token).expect("the rogue issued");
    assert_eq!(cert_uris(&rogue_cert), vec![id.uri()]);
    let rogue_csrs = distinct_csrs(&rogue);
    assert!(
        env.svc.requests().is_empty(),
        "the real service was reached"
    );
    nothing_enrolled(&env);
    assert!(env.state().join("pending.json").exists());

    // The real service back on the port: the same CSR (the refusal kept it), certified by
    // the pinned CA, published.
    drop(rogue);
    env.svc.listen_vm(VM, &upstream).unwrap();
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        distinct_csrs(&env.svc),
        rogue_csrs,
        "the pending CSR was not the one re-sent"
    );
    let cert = env.published();
    assert_eq!(Some(cert.clone()), env.svc.committed_cert(&token));
    let (_, ca) = X509Certificate::from_der(env.svc.ca_der()).unwrap();
    assert_eq!(issuer_of(&cert), ca.subject().to_string());
    assert_eq!(
        cert_key(&cert),
        cert_key(&rogue_cert),
        "a second key was made"
    );
    env.assert_no_secrets();
}

#[test]
fn a_guest_clock_ten_minutes_off_enrolls_and_twenty_minutes_behind_is_refused() {
    let Some(lib) = libfaketime() else {
        require(false, "libfaketime (Debian package libfaketime)");
        return;
    };
    for offset in ["-10m", "+10m"] {
        let mut env = Env::new(&[VM], VM);
        let id = identity(VM, 1);
        let token = env.provision(&id);
        let (code, out) = run_guest_at(&mut env, &lib, offset);
        assert_eq!(code, 0, "guest clock {offset}: {out}");
        assert_eq!(Some(env.published()), env.svc.committed_cert(&token));
        if offset == "-10m" {
            // The shift reached the guest: it saw notBefore ahead of its clock.
            assert!(
                out.contains("ahead of the guest clock (tolerated up to 900 s)"),
                "{out}"
            );
        }
        env.assert_no_secrets();
    }

    // The control: 20 minutes behind is beyond the tolerance. Refused, blaming the clock,
    // nothing published; with the clock right, the same CSR enrolls.
    let mut env = Env::new(&[VM], VM);
    let id = identity(VM, 1);
    let token = env.provision(&id);
    let (code, out) = run_guest_at(&mut env, &lib, "-20m");
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("the guest clock is behind the CA's"), "{out}");
    nothing_enrolled(&env);
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    assert_eq!(distinct_csrs(&env.svc).len(), 1, "a second CSR was made");
    assert_eq!(Some(env.published()), env.svc.committed_cert(&token));
    env.assert_no_secrets();
}

#[test]
fn a_pushed_document_cannot_choose_the_ca() {
    // A host process that can both push and answer on the service endpoint: its document
    // pins its own CA. The image's configured pin refuses it before anything is sent; the
    // guest keeps waiting, and the platform's document then enrolls.
    let mut env = Env::new(&[VM], VM);
    let rogue = EnrollService::start().unwrap();
    let rogue_id = identity(VM, u64::MAX);
    let rogue_token = new_token("rogue");
    rogue
        .register(&rogue_token, &rogue_id, Duration::from_secs(600))
        .unwrap();
    let upstream = env.path(&format!("svc-{VM}.sock"));
    rogue.listen_vm(VM, &upstream).unwrap();
    let mut child = spawn_push_guest(&env);
    let sock = env.path("push.sock");
    // The guest's log, line by line, to see the refusal as it happens.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut all = String::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line.clone());
            all.push_str(&line);
            all.push('\n');
        }
        all
    });

    let mut doc: serde_json::Value =
        serde_json::from_str(&env.material_doc(&rogue_token, &rogue_id, 4_000_000_000)).unwrap();
    doc["management_ca"] = rogue.management_ca_b64().into();
    assert_eq!(push(&sock, &doc.to_string()), "ok\n");
    let refusal = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("no refusal logged");
        if line.contains("waiting for another push") {
            break line;
        }
    };
    assert!(refusal.contains("but the configuration pins"), "{refusal}");
    assert!(rogue.requests().is_empty(), "the rogue was asked");
    assert!(!env.state().join("pending.json").exists());
    nothing_enrolled(&env);

    drop(rogue);
    env.svc.listen_vm(VM, &upstream).unwrap();
    let id = identity(VM, 2);
    let (token, expires) = env.register("legit", &id, Duration::from_secs(600));
    let doc = env.material_doc(&token, &id, expires);
    assert_eq!(push(&sock, &doc), "ok\n");
    let status = child.wait().unwrap();
    let out = reader.join().unwrap();
    env.output.push(out.clone());
    env.collect_keys();
    assert!(status.success(), "{out}");
    assert_eq!(Some(env.published()), env.svc.committed_cert(&token));
    env.assert_no_secrets();
}
