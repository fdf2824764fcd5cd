//! The check that every map key of a message is a string, made before any decode.
//!
//! serde's derived structs take a map key that is an integer as the index of a field
//! (`{1: "x"}` sets a struct's second field). Two readers of one body could then disagree on
//! its job id: one decoding the whole `JobSpec` (whose field 1 is `job_id`), one peeking at
//! `job_id` alone (whose field 1 does not exist). The fuzz test in tests/delivery.rs found such
//! a body: the worker dead-lettered it as having no id, and the dead-letter consumer found one.
//! docs/protocol.md says every key is a string, so any other key is refused.

/// The offset of the first map key in the first MessagePack value of `bytes` that is not a
/// string, at any depth up to `max_depth` containers; `None` when there is none. Bytes that are
/// not MessagePack, truncated or nested deeper end the scan with `None`: the decoder that
/// follows reports those. Reads each byte at most once and allocates nothing.
pub(crate) fn first_non_string_key(bytes: &[u8], max_depth: usize) -> Option<usize> {
    let mut scan = Scan { bytes, at: 0 };
    scan.value(max_depth).err().flatten()
}

/// A cursor over the bytes. `Err(Some(offset))`: a key that is not a string; `Err(None)`: the
/// scan cannot go on (malformed, truncated or too deep).
struct Scan<'a> {
    bytes: &'a [u8],
    at: usize,
}

type Step = Result<(), Option<usize>>;

impl Scan<'_> {
    fn byte(&mut self) -> Result<u8, Option<usize>> {
        let b = *self.bytes.get(self.at).ok_or(None)?;
        self.at += 1;
        Ok(b)
    }

    /// A big-endian unsigned length of `n` bytes (1, 2 or 4).
    fn length(&mut self, n: usize) -> Result<usize, Option<usize>> {
        let mut value = 0usize;
        for _ in 0..n {
            value = (value << 8) | usize::from(self.byte()?);
        }
        Ok(value)
    }

    fn skip(&mut self, n: usize) -> Step {
        let end = self.at.checked_add(n).filter(|&end| end <= self.bytes.len()).ok_or(None)?;
        self.at = end;
        Ok(())
    }

    /// Whether the value at the cursor is a string (the cursor does not move).
    fn at_string(&self) -> bool {
        matches!(self.bytes.get(self.at), Some(0xa0..=0xbf | 0xd9..=0xdb))
    }

    /// Skips one value, checking the keys of every map in it.
    fn value(&mut self, depth: usize) -> Step {
        let marker = self.byte()?;
        let (items, pairs) = match marker {
            0x00..=0x7f | 0xc0 | 0xc2 | 0xc3 | 0xe0..=0xff => return Ok(()),
            0x80..=0x8f => (usize::from(marker & 0x0f), true),
            0x90..=0x9f => (usize::from(marker & 0x0f), false),
            0xa0..=0xbf => return self.skip(usize::from(marker & 0x1f)),
            0xc4 | 0xd9 => {
                let n = self.length(1)?;
                return self.skip(n);
            }
            0xc5 | 0xda => {
                let n = self.length(2)?;
                return self.skip(n);
            }
            0xc6 | 0xdb => {
                let n = self.length(4)?;
                return self.skip(n);
            }
            // ext 8/16/32: a length, a type byte, the data.
            0xc7 => {
                let n = self.length(1)?;
                return self.skip(n + 1);
            }
            0xc8 => {
                let n = self.length(2)?;
                return self.skip(n + 1);
            }
            0xc9 => {
                let n = self.length(4)?;
                return self.skip(n.saturating_add(1));
            }
            0xca => return self.skip(4),
            0xcb => return self.skip(8),
            0xcc | 0xd0 => return self.skip(1),
            0xcd | 0xd1 => return self.skip(2),
            0xce | 0xd2 => return self.skip(4),
            0xcf | 0xd3 => return self.skip(8),
            // fixext 1/2/4/8/16: a type byte and the data.
            0xd4 => return self.skip(2),
            0xd5 => return self.skip(3),
            0xd6 => return self.skip(5),
            0xd7 => return self.skip(9),
            0xd8 => return self.skip(17),
            0xdc => (self.length(2)?, false),
            0xdd => (self.length(4)?, false),
            0xde => (self.length(2)?, true),
            0xdf => (self.length(4)?, true),
            // 0xc1 is never used.
            0xc1 => return Err(None),
        };
        let depth = depth.checked_sub(1).ok_or(None)?;
        // Each item takes at least one byte, so the loop ends within the body's length.
        for _ in 0..items {
            if pairs {
                if !self.at_string() {
                    return Err(if self.at < self.bytes.len() { Some(self.at) } else { None });
                }
                self.value(depth)?;
            }
            self.value(depth)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::first_non_string_key;

    fn encode(value: &rmpv::Value) -> Vec<u8> {
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, value).expect("encode");
        bytes
    }

    #[test]
    fn integer_keys_are_found_at_any_depth_and_string_keys_pass() {
        use rmpv::Value;
        let good = Value::Map(vec![
            ("a".into(), Value::Array(vec![Value::Map(vec![("b".into(), 1.into())]), Value::Binary(vec![1; 300])])),
            ("c".into(), Value::Ext(3, vec![0; 70_000])),
            ("d".into(), Value::F64(1.5)),
        ]);
        assert_eq!(first_non_string_key(&encode(&good), 32), None);
        let top = Value::Map(vec![("a".into(), 1.into()), (Value::from(1), "job_id".into())]);
        let bytes = encode(&top);
        // fixmap, "a" (2 bytes), 1, then the key 1 at offset 4.
        assert_eq!(first_non_string_key(&bytes, 32), Some(4));
        let nested = Value::Map(vec![("inputs".into(), Value::Array(vec![Value::Map(vec![(Value::Nil, 1.into())])]))]);
        assert!(first_non_string_key(&encode(&nested), 32).is_some());
    }

    #[test]
    fn truncated_or_too_deep_bodies_are_left_to_the_decoder() {
        use rmpv::Value;
        let top = encode(&Value::Map(vec![("a".into(), 1.into()), (Value::from(1), "x".into())]));
        assert_eq!(first_non_string_key(&top[..4], 32), None);
        let mut deep = Value::Map(vec![(Value::from(1), 1.into())]);
        for _ in 0..3 {
            deep = Value::Array(vec![deep]);
        }
        assert_eq!(first_non_string_key(&encode(&deep), 3), None);
        assert!(first_non_string_key(&encode(&deep), 4).is_some());
        assert_eq!(first_non_string_key(&[0xdf, 0xff, 0xff, 0xff, 0xff], 32), None);
    }
}
