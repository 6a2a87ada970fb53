//! The reference service's seed-002 denials, as the real guest sees them through the real
//! relay: each reaches `guest-init enroll` as a final error naming its code (exit 3, no
//! further request), and nothing is published. An outage of the current-identity source is
//! the one retryable case, and it still fails closed.

use super::*;

/// Runs a guest that the service commits for and stalls; kills it there (the guest died
/// between send and receive) and returns the committed certificate.
fn commit_then_kill_the_guest(env: &mut Env, token: &str) -> Vec<u8> {
    env.svc.stall_after_commit();
    let mut child = env.spawn_guest();
    wait_until("the service to commit and stall", || env.svc.stalled() == 1);
    child.kill().unwrap();
    let _ = env.finish(child);
    assert!(env.state().join("pending.json").exists());
    env.svc.committed_cert(token).expect("committed")
}

/// Lets the stalled request go and waits until it is answered (into the dead connection),
/// so the next request counts are the next run's alone.
fn release_and_settle(env: &Env) {
    env.svc.release_stall();
    wait_until("the stalled request to be answered", || {
        env.svc.requests().len() == 1
    });
}

/// The denial as the guest must report it: final, exit 3, the code named.
fn assert_final(code: i32, out: &str, name: &str) {
    assert_eq!(code, 3, "expected a final refusal: {out}");
    assert!(
        out.contains(&format!("enrollment denied ({name})")),
        "the guest must name `{name}`: {out}"
    );
}

fn nothing_published(env: &Env) -> bool {
    !env.publish().join("cert.pem").exists()
}

/// Denied and not retried: the service saw exactly one more request after `before`.
fn assert_not_retried(env: &Env, before: usize) {
    assert_eq!(
        env.svc.requests().len(),
        before + 1,
        "a final error was retried"
    );
}

/// The current identity changed to `current` after the token was minted and before the
/// guest asked: final, the guest's message says `why`, nothing issued or published.
fn denied_before_enrollment(current: Identity, why: &str) {
    let mut env = Env::new(&[VM], VM);
    let token = env.provision(&identity(VM, 3));
    env.svc.set_current(&current);
    let (code, out) = env.run_guest();
    assert_final(code, &out, "identity_changed");
    assert!(out.contains(why), "{out}");
    assert_not_retried(&env, 0);
    assert_eq!(
        env.svc.committed_cert(&token),
        None,
        "a stale identity was issued"
    );
    assert!(nothing_published(&env));
    env.assert_no_secrets();
}

#[test]
fn a_vm_reset_before_enrollment_is_final_and_nothing_is_issued() {
    // The VM was reset after the token was minted: a new VM UID is current.
    denied_before_enrollment(identity("vm-1-reset", 3), "VM was reset");
}

#[test]
fn an_epoch_raised_before_enrollment_is_final_and_nothing_is_issued() {
    denied_before_enrollment(identity(VM, 4), "revocation epoch is 4");
}

/// Committed for the guest, which dies before the answer; `change` happens; the guest
/// resumes its pending CSR and gets the final `code`. Returns the guest's output.
fn final_on_resume(env: &mut Env, token: &str, change: impl FnOnce(&Env), code: &str) -> String {
    commit_then_kill_the_guest(env, token);
    change(env);
    release_and_settle(env);
    let before = env.svc.requests().len();
    let (status, out) = env.run_guest();
    assert!(out.contains("resuming the pending enrollment"), "{out}");
    assert_final(status, &out, code);
    assert_not_retried(env, before);
    assert!(nothing_published(env));
    env.assert_no_secrets();
    out
}

#[test]
fn an_epoch_raised_before_a_retry_is_final() {
    // Committed at epoch 3, the guest dies before the answer, the epoch is raised, the
    // guest resumes the pending CSR: the committed certificate is not handed out.
    let mut env = Env::new(&[VM], VM);
    let token = env.provision(&identity(VM, 3));
    let raise = |env: &Env| env.svc.set_current(&identity(VM, 4));
    final_on_resume(&mut env, &token, raise, "identity_changed");
}

/// The service commits and stalls; `change` happens before it answers; the recheck after
/// the commit withholds the certificate with the final `code`. Returns the requests.
fn withheld_after_commit(
    env: &mut Env,
    change: impl FnOnce(&Env),
    code: &str,
) -> Vec<e2e::enroll_service::RequestRecord> {
    env.svc.stall_after_commit();
    let child = env.spawn_guest();
    wait_until("the service to commit and stall", || env.svc.stalled() == 1);
    change(env);
    env.svc.release_stall();
    let (status, out) = env.finish(child);
    assert_final(status, &out, code);
    assert!(out.contains("withheld after commit"), "{out}");
    assert_not_retried(env, 0);
    assert!(nothing_published(env));
    env.assert_no_secrets();
    env.svc.requests()
}

#[test]
fn a_vm_reset_during_issuance_withholds_the_certificate() {
    // The service has committed and not yet answered when the VM is reset: the recheck
    // after the commit withholds the certificate.
    let mut env = Env::new(&[VM], VM);
    let token = env.provision(&identity(VM, 3));
    let reset = |env: &Env| env.svc.set_current(&identity("vm-1-reset", 3));
    let reqs = withheld_after_commit(&mut env, reset, "identity_changed");
    assert_eq!(reqs[0].cert, None, "the certificate was sent");
    assert!(env.svc.committed_cert(&token).is_some(), "the commit stays");
}

#[test]
fn an_epoch_raised_during_issuance_withholds_the_certificate() {
    let mut env = Env::new(&[VM], VM);
    env.provision(&identity(VM, 3));
    let raise = |env: &Env| env.svc.set_current(&identity(VM, 4));
    withheld_after_commit(&mut env, raise, "identity_changed");
}

#[test]
fn a_token_expiring_during_issuance_withholds_the_certificate() {
    // The trusted clock is reread after the commit: the token ran out meanwhile.
    let mut env = Env::new(&[VM], VM);
    let id = identity(VM, 3);
    let (token, expires) = env.register("exp", &id, Duration::from_secs(60));
    env.write_material(&token, &id, expires);
    let later = |env: &Env| env.svc.advance_clock(Duration::from_secs(120));
    withheld_after_commit(&mut env, later, "expired");
}

#[test]
fn a_retry_after_the_issued_certificate_expired_is_final() {
    // Certificates live 2 minutes here, the token 10. Committed, the guest dies before the
    // answer, 5 minutes pass (the token is still valid): the retry is refused.
    let mut env = Env::new(&[VM], VM);
    env.svc.set_cert_lifetime(Duration::from_secs(120));
    let token = env.provision(&identity(VM, 3));
    let later = |env: &Env| env.svc.advance_clock(Duration::from_secs(300));
    let out = final_on_resume(&mut env, &token, later, "expired");
    assert!(
        out.contains("certificate issued for this CSR has expired"),
        "{out}"
    );
}

#[test]
fn a_full_ledger_denies_instead_of_evicting() {
    // Room for one certificate. The first enrollment takes it; new material for the next
    // epoch is denied, and the first certificate stays committed and published.
    let mut env = Env::new(&[VM], VM);
    env.svc.set_capacity(1);
    let first = env.provision(&identity(VM, 1));
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    let cert = env.published();

    let second = env.provision(&identity(VM, 2));
    let before = env.svc.requests().len();
    let (code, out) = env.run_guest();
    assert_final(code, &out, "capacity_exhausted");
    assert_not_retried(&env, before);
    assert_eq!(env.svc.committed_cert(&second), None);
    assert_eq!(
        env.svc.committed_cert(&first),
        Some(cert.clone()),
        "a credential was evicted"
    );
    assert_eq!(env.published(), cert, "something new was published");
    env.assert_no_secrets();
}

#[test]
fn an_identity_source_outage_fails_closed_and_is_retried() {
    // Not a denial: the lookup is down, so nothing is issued (`unavailable`, retryable).
    // The guest uses its retry budget (5 attempts here) and exits 4; once the source is
    // back, the same material enrolls.
    let mut env = Env::new(&[VM], VM);
    let token = env.provision(&identity(VM, 3));
    env.svc.set_identity_outage(true);
    let (code, out) = env.run_guest();
    assert_eq!(code, 4, "{out}");
    let reqs = env.svc.requests();
    assert_eq!(reqs.len(), 5, "{out}");
    assert!(reqs.iter().all(|r| r.code == Some(ErrorCode::Unavailable)));
    assert_eq!(
        env.svc.committed_cert(&token),
        None,
        "issued during an outage"
    );
    assert!(nothing_published(&env));

    env.svc.set_identity_outage(false);
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    assert_eq!(Some(env.published()), env.svc.committed_cert(&token));
    env.assert_no_secrets();
}
