//! The service's source of each workspace's *current* identity: a stand-in for the
//! platform's workspace controller.
//!
//! Seed 002 has the service ask the controller, with a fresh lookup on every decision, which
//! VM UID and revocation epoch a workspace has now; a token bound to anything else is
//! refused, and an outage of that lookup fails closed. Here the controller is a map the test
//! changes ([`super::EnrollService::set_current`], [`super::EnrollService::remove_current`])
//! and can take down ([`super::EnrollService::set_identity_outage`]). Registering a token
//! makes its binding current, as a controller mints tokens for the identity it holds.

use std::collections::HashMap;
use std::sync::Mutex;

use guest_init::enroll::identity::Identity;
use guest_init::enroll::protocol::{ErrorCode, Response};

use super::lock;

/// What the controller says a workspace is now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CurrentIdentity {
    /// The VM UID of the workspace's current VM incarnation (a reset changes it).
    pub vm_uid: String,
    /// The current revocation epoch (it only goes up).
    pub epoch: u64,
}

/// The controller stand-in: workspace → current identity, plus an outage switch.
#[derive(Default)]
pub(super) struct Controller {
    current: Mutex<HashMap<String, CurrentIdentity>>,
    outage: Mutex<bool>,
    lookups: Mutex<u64>,
}

/// The workspace part of an identity, the controller's key.
fn workspace(id: &Identity) -> String {
    format!(
        "{}/{}/{}",
        id.workspace_namespace, id.workspace_name, id.workspace_uid
    )
}

impl Controller {
    pub(super) fn set(&self, id: &Identity) {
        lock(&self.current).insert(
            workspace(id),
            CurrentIdentity {
                vm_uid: id.vm_uid.clone(),
                epoch: id.epoch,
            },
        );
    }

    pub(super) fn remove(&self, id: &Identity) {
        lock(&self.current).remove(&workspace(id));
    }

    pub(super) fn set_outage(&self, on: bool) {
        *lock(&self.outage) = on;
    }

    pub(super) fn lookups(&self) -> u64 {
        *lock(&self.lookups)
    }

    /// A fresh lookup: `Err(())` during an outage.
    fn lookup(&self, id: &Identity) -> Result<Option<CurrentIdentity>, ()> {
        *lock(&self.lookups) += 1;
        if *lock(&self.outage) {
            return Err(());
        }
        Ok(lock(&self.current).get(&workspace(id)).cloned())
    }

    /// Whether `binding` is its workspace's current identity, by a fresh lookup. Fails
    /// closed: an outage is `unavailable` (retryable, nothing issued), anything but an exact
    /// match of VM UID and epoch is `identity_changed` (final). `when` says at which point
    /// of the request the check ran, for the message.
    pub(super) fn check(&self, binding: &Identity, when: &str) -> Result<(), Response> {
        let current = match self.lookup(binding) {
            Err(()) => {
                return Err(Response::error(
                    ErrorCode::Unavailable,
                    format!("{when}: the workspace's current identity cannot be looked up now"),
                ))
            }
            Ok(None) => {
                return Err(Response::error(
                    ErrorCode::IdentityChanged,
                    format!("{when}: the token's workspace has no current identity"),
                ))
            }
            Ok(Some(c)) => c,
        };
        if current.vm_uid != binding.vm_uid {
            return Err(Response::error(
                ErrorCode::IdentityChanged,
                format!(
                    "{when}: the workspace's VM was reset (current VM UID {}, the token's {})",
                    current.vm_uid, binding.vm_uid
                ),
            ));
        }
        if current.epoch != binding.epoch {
            return Err(Response::error(
                ErrorCode::IdentityChanged,
                format!(
                    "{when}: the workspace's revocation epoch is {}, the token's {}",
                    current.epoch, binding.epoch
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(vm: &str, epoch: u64) -> Identity {
        Identity {
            workspace_namespace: "ns".into(),
            workspace_name: "ws".into(),
            workspace_uid: "uid-1".into(),
            vm_uid: vm.into(),
            epoch,
        }
    }

    fn code(r: Result<(), Response>) -> Option<ErrorCode> {
        r.err().and_then(|r| r.code)
    }

    #[test]
    fn only_the_exact_current_identity_passes_and_an_outage_fails_closed() {
        let c = Controller::default();
        let token = id("vm-1", 3);
        assert_eq!(code(c.check(&token, "t")), Some(ErrorCode::IdentityChanged));
        c.set(&token);
        assert!(c.check(&token, "t").is_ok());
        c.set(&id("vm-2", 3));
        assert_eq!(code(c.check(&token, "t")), Some(ErrorCode::IdentityChanged));
        c.set(&id("vm-1", 4));
        assert_eq!(code(c.check(&token, "t")), Some(ErrorCode::IdentityChanged));
        c.set(&token);
        c.set_outage(true);
        assert_eq!(code(c.check(&token, "t")), Some(ErrorCode::Unavailable));
        c.set_outage(false);
        assert!(c.check(&token, "t").is_ok());
        c.remove(&token);
        assert_eq!(code(c.check(&token, "t")), Some(ErrorCode::IdentityChanged));
        assert_eq!(c.lookups(), 7, "every check is a fresh lookup");
    }
}
