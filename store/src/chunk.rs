//! How one chunk is stored: lz4 block compression when it pays, raw bytes when it does not,
//! and the digest check every read goes through.

use crate::Digest;

/// A chunk ready to be stored: its digest (over the uncompressed bytes), its uncompressed
/// length and the bytes to write. `stored.len() == length` means stored raw.
#[derive(Debug, Clone)]
pub struct EncodedChunk {
    pub digest: Digest,
    pub length: u32,
    pub stored: Vec<u8>,
}

/// Hashes and compresses one chunk. Incompressible data is kept raw, so a stored length
/// equal to the logical length always means "not compressed".
pub fn encode(data: &[u8]) -> EncodedChunk {
    let digest = Digest::of(data);
    let compressed = lz4_flex::block::compress(data);
    let stored = if compressed.len() < data.len() {
        compressed
    } else {
        data.to_vec()
    };
    EncodedChunk {
        digest,
        length: data.len() as u32,
        stored,
    }
}

/// Why stored chunk bytes could not be turned back into the chunk they claim to be.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("lz4 data does not decompress: {0}")]
    Corrupt(String),
    #[error("content digest is {actual}, expected {expected}")]
    DigestMismatch { expected: Digest, actual: Digest },
}

/// Decompresses and verifies one stored chunk.
pub fn decode(stored: &[u8], length: u32, expected: &Digest) -> Result<Vec<u8>, DecodeError> {
    let data = if stored.len() == length as usize {
        stored.to_vec()
    } else {
        lz4_flex::block::decompress(stored, length as usize)
            .map_err(|e| DecodeError::Corrupt(e.to_string()))?
    };
    if data.len() != length as usize {
        return Err(DecodeError::Corrupt(format!(
            "decompressed to {} bytes, expected {length}",
            data.len()
        )));
    }
    let actual = Digest::of(&data);
    if &actual != expected {
        return Err(DecodeError::DigestMismatch {
            expected: *expected,
            actual,
        });
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compressible_and_raw_round_trip() {
        let text = b"hello hello hello hello hello hello hello hello".repeat(100);
        let enc = encode(&text);
        assert!(enc.stored.len() < text.len());
        assert_eq!(decode(&enc.stored, enc.length, &enc.digest).unwrap(), text);

        let noise: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let enc = encode(&noise);
        assert_eq!(decode(&enc.stored, enc.length, &enc.digest).unwrap(), noise);
    }

    #[test]
    fn corruption_is_detected() {
        let text = b"abcdefgh".repeat(1000);
        let mut enc = encode(&text);
        let last = enc.stored.len() - 1;
        enc.stored[last] ^= 0xff;
        assert!(decode(&enc.stored, enc.length, &enc.digest).is_err());
    }
}
