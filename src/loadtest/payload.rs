//! The load-test event payload: `{seq} {sent_us} {target} {padding}`, plain ASCII so that it
//! needs no JSON escaping and any SSE server carries it unchanged. `seq` counts per device
//! (unicast), per group (group events) or per run (broadcast), `sent_us` is the wall clock in
//! microseconds when the publisher built the batch, `target` is the device index, `g` and the
//! group's index for a group event (`g7` for `g1-7`), or `b` for a broadcast; the padding
//! brings the payload to the requested size. Loss, duplicates, order and misrouting are
//! counted exactly from these fields.

use std::time::{SystemTime, UNIX_EPOCH};

/// Shortest payload size: room for the fields themselves.
pub const MIN_SIZE: usize = 48;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub seq: u64,
    pub sent_us: u64,
    pub target: Target,
}

/// Whom an event is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The device of this index.
    Device(u64),
    /// Every member of the group of ten of this index (`g1-<index>`, see `Run::stream_path`).
    Group(u64),
    Broadcast,
}

impl Stamp {
    pub fn encode(&self, size: usize) -> String {
        let mut text = match self.target {
            Target::Device(device) => format!("{} {} {device} ", self.seq, self.sent_us),
            Target::Group(group) => format!("{} {} g{group} ", self.seq, self.sent_us),
            Target::Broadcast => format!("{} {} b ", self.seq, self.sent_us),
        };
        let pad = size.saturating_sub(text.len());
        text.extend(std::iter::repeat_n('x', pad));
        text
    }

    /// `None` for anything that is not a load-test payload.
    pub fn parse(data: &[u8]) -> Option<Stamp> {
        let mut fields = data.split(|b| *b == b' ');
        let seq = number(fields.next()?)?;
        let sent_us = number(fields.next()?)?;
        let target = match fields.next()? {
            b"b" => Target::Broadcast,
            [b'g', group @ ..] => Target::Group(number(group)?),
            device => Target::Device(number(device)?),
        };
        Some(Stamp {
            seq,
            sent_us,
            target,
        })
    }
}

fn number(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    digits.iter().try_fold(0u64, |n, b| {
        b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0'))
    })
}

pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_with_padding() {
        for target in [Target::Device(17), Target::Group(3), Target::Broadcast] {
            let stamp = Stamp {
                seq: 42,
                sent_us: 1_764_000_000_000_000,
                target,
            };
            let text = stamp.encode(200);
            assert_eq!(text.len(), 200);
            assert_eq!(Stamp::parse(text.as_bytes()), Some(stamp));
        }
    }

    #[test]
    fn foreign_data_is_not_a_stamp() {
        for data in [
            &b"{\"reason\":\"expired\"}"[..],
            b"",
            b"1 2",
            b"1 x 3 ",
            b"1 2 3x ",
            b"1 2 g ",
            b"1 2 gx ",
        ] {
            assert_eq!(
                Stamp::parse(data),
                None,
                "{:?}",
                String::from_utf8_lossy(data)
            );
        }
    }
}
