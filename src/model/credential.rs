//! What a stream was opened with: when its token was issued and when it expires, and the
//! device's groups. The hub ends the stream at `exp` plus `auth.leeway`, and a revocation ends
//! the streams (and refuses the tokens) of its device issued until then.

use super::Groups;

/// The `iat` and `exp` of a stream's token (Unix seconds), both `None` without a token
/// (`auth.mode = "none"`), and the groups its device is a member of (the token's `groups`
/// claim, or `?groups=` without tokens).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Credential {
    pub issued: Option<u64>,
    pub expires: Option<u64>,
    pub groups: Groups,
}

impl Credential {
    /// Whether the stream came with a token (jwt mode requires `exp`).
    pub fn has_token(&self) -> bool {
        self.expires.is_some()
    }

    /// Whether a revocation at `at_ms` (Unix ms) covers this token: one issued in that second or
    /// before, or one that does not say when it was issued. Seconds are all `iat` has, so a
    /// token minted in the second of the revocation counts as before it.
    pub fn revoked_by(&self, at_ms: u64) -> bool {
        self.issued.is_none_or(|issued| issued <= at_ms / 1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token issued up to the second of the revocation is revoked, one without `iat` too; one
    /// issued the next second is not.
    #[test]
    fn revocation_covers_tokens_issued_until_its_second() {
        let at_ms = 1_796_070_072_577;
        let issued = |issued| Credential {
            issued,
            expires: Some(1_796_080_000),
            groups: Groups::default(),
        };
        assert!(issued(Some(1_796_070_071)).revoked_by(at_ms));
        assert!(issued(Some(1_796_070_072)).revoked_by(at_ms));
        assert!(!issued(Some(1_796_070_073)).revoked_by(at_ms));
        assert!(issued(None).revoked_by(at_ms));
        assert!(!Credential::default().has_token());
        assert!(issued(None).has_token());
    }
}
