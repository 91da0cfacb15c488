//! The load-test event payload: `{seq} {sent_us} {target} {padding}`, plain ASCII so that it
//! needs no JSON escaping and any SSE server carries it unchanged. `seq` counts per device
//! (unicast) or per run (broadcast), `sent_us` is the wall clock in microseconds when the
//! publisher built the batch, `target` is the device index or `b` for a broadcast; the padding
//! brings the payload to the requested size. Loss, duplicates, order and misrouting are
//! counted exactly from these fields.

use std::time::{SystemTime, UNIX_EPOCH};

/// Shortest payload size: room for the fields themselves.
pub const MIN_SIZE: usize = 48;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub seq: u64,
    pub sent_us: u64,
    /// Device index, or `None` for a broadcast.
    pub target: Option<u64>,
}

impl Stamp {
    pub fn encode(&self, size: usize) -> String {
        let mut text = match self.target {
            Some(device) => format!("{} {} {device} ", self.seq, self.sent_us),
            None => format!("{} {} b ", self.seq, self.sent_us),
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
            b"b" => None,
            device => Some(number(device)?),
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
        for target in [Some(17), None] {
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
