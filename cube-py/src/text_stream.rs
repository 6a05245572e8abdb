//! Turns a byte stream that arrives in arbitrary chunks into text, never splitting a
//! UTF-8 sequence across two callbacks.

/// An incremental UTF-8 decoder; invalid bytes become U+FFFD.
#[derive(Default)]
pub struct TextStream {
    pending: Vec<u8>,
}

impl TextStream {
    /// Adds `chunk` and returns the text complete so far (a sequence cut at the end of
    /// the chunk waits for the next one).
    pub fn push(&mut self, chunk: &[u8]) -> String {
        self.pending.extend_from_slice(chunk);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    out.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[bad..];
                        }
                        // An incomplete sequence at the end: keep it for the next chunk.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// The text of whatever is left when the stream ends.
    pub fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&rest).into_owned()
    }
}
