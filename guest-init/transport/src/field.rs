//! A configuration error that names its field.
//!
//! guest-init's and host-relay's configurations, and the forwarding specs they share, all
//! report a bad value the same way: the field's path (`services[0].mode`) and what is
//! wrong with it, with the fix. One type, so a message reads the same from either binary.

use std::fmt;

/// A field has a value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct FieldError {
    /// The field, as a path into the document: `services[0].dovecot.client_address`.
    pub field: String,
    /// What is wrong, and how to fix it.
    pub reason: String,
}

impl FieldError {
    /// A field error.
    pub fn new(field: impl fmt::Display, reason: impl Into<String>) -> Self {
        FieldError {
            field: field.to_string(),
            reason: reason.into(),
        }
    }
}
