//! Sharding: `shard = crc32_ieee(utf8(device_id)) mod shards` (docs/stream-format.md), the same CRC-32 as zlib,
//! Python's `zlib.crc32` and Go's `crc32.ChecksumIEEE`, so producers in any language agree.

pub fn shard_of(device: &str, shards: u32) -> u32 {
    crc32fast::hash(device.as_bytes()) % shards
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known vectors computed with Python's `zlib.crc32` (and the standard check value).
    #[test]
    fn crc32_matches_zlib_vectors() {
        // zlib.crc32(b"123456789") == 0xCBF43926, the CRC-32/IEEE check value.
        assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
        // zlib.crc32(b"pos-17") == 2524787842; zlib.crc32(b"pos-1") == 2079751259
        assert_eq!(crc32fast::hash(b"pos-17"), 2_524_787_842);
        assert_eq!(crc32fast::hash(b"pos-1"), 2_079_751_259);
        assert_eq!(shard_of("pos-17", 64), 2_524_787_842 % 64);
        assert_eq!(shard_of("pos-1", 64), 2_079_751_259 % 64);
    }

    /// Every shard index is below the shard count.
    #[test]
    fn shard_is_in_range() {
        for i in 0..1000 {
            assert!(shard_of(&format!("dev-{i}"), 7) < 7);
        }
    }
}
