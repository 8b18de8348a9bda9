//! What `--data` (and `--eval-data`) name, read into tokens: the built-in text, a text file,
//! a JSON-lines file of `{"text": …}` documents, or pre-tokenized binaries (llm.c's `.bin` with
//! its 256 × int32 header, nanoGPT's raw uint16 `.bin`). Text is tokenised byte by byte, or by
//! a Hugging Face `tokenizer.json` (`--tokenizer`, with the `tokenizers` crate); documents are
//! joined by the tokenizer's end-of-text token. Every token must be inside the model's
//! vocabulary: the first that is not is named with its position.

use std::path::Path;
use std::sync::Arc;

use super::Source;

/// llm.c's `.bin` header: 256 little-endian int32, the first this magic.
pub const LLMC_MAGIC: i32 = 20240520;
const LLMC_HEADER_BYTES: usize = 256 * 4;

/// Largest data file read whole (the tokens of a 4 GB file are 16 GB as `i64` windows are cut
/// from them lazily, but the file itself is held).
const MAX_DATA_BYTES: u64 = 8 << 30;

/// The label a source has in events and checkpoints: the path, and the tokenizer when one is
/// used (`train.jsonl with tokenizer tok.json`), which [`open`] reads back.
pub fn label(spec: &str, tokenizer: Option<&Path>) -> String {
    match tokenizer {
        Some(t) => format!("{spec}{TOKENIZER_SEP}{}", t.display()),
        None => spec.to_string(),
    }
}

const TOKENIZER_SEP: &str = " with tokenizer ";

/// Split a label made by [`label`] back into the data and the tokenizer.
pub fn parse_label(label: &str) -> (&str, Option<&Path>) {
    match label.rsplit_once(TOKENIZER_SEP) {
        Some((data, t)) => (data, Some(Path::new(t))),
        None => (label, None),
    }
}

/// Read `spec` (`shakespeare`, `random`, or a path) for a model of `vocab` tokens, samples of
/// `seq` + 1 tokens; `flag` (`--data`, `--eval-data`) names it in messages.
pub fn open(
    flag: &str,
    spec: &str,
    tokenizer: Option<&Path>,
    vocab: u64,
    seq: usize,
) -> Result<Source, String> {
    let name = label(spec, tokenizer);
    let tokens: Vec<u32> = match (spec, tokenizer) {
        ("random", None) => return Ok(Source::Random),
        ("random", Some(_)) => return Err(format!("{flag} random needs no --tokenizer")),
        ("shakespeare", None) => return Ok(Source::shakespeare()),
        ("shakespeare", Some(t)) => {
            let text = String::from_utf8_lossy(super::SHAKESPEARE);
            encode_all(&load_tokenizer(t)?, [text.as_ref()].into_iter(), false)?
        }
        (path, tok) => from_file(flag, Path::new(path), tok)?,
    };
    check(&format!("{flag} {spec}"), &tokens, vocab, seq)?;
    Ok(Source::Tokens {
        name,
        tokens: Arc::new(tokens),
    })
}

fn from_file(flag: &str, path: &Path, tokenizer: Option<&Path>) -> Result<Vec<u32>, String> {
    let shown = format!("{flag} {}", path.display());
    let meta = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("{shown}: not a file"));
    }
    if meta.len() > MAX_DATA_BYTES {
        return Err(format!(
            "{shown}: {} bytes is more than the {MAX_DATA_BYTES} read whole",
            meta.len()
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("{shown}: {e}"))?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match (ext, tokenizer) {
        ("bin", Some(_)) => Err(format!(
            "{shown}: a .bin file is already tokens; drop --tokenizer"
        )),
        ("bin", None) => binary_tokens(&bytes).map_err(|e| format!("{shown}: {e}")),
        ("jsonl", Some(t)) => {
            let tok = load_tokenizer(t)?;
            let docs = documents(&bytes).map_err(|e| format!("{shown}: {e}"))?;
            encode_all(&tok, docs.iter().map(String::as_str), true)
        }
        ("jsonl", None) => Err(format!(
            "{shown}: JSON-lines documents need --tokenizer tokenizer.json"
        )),
        (_, Some(t)) => {
            let text =
                String::from_utf8(bytes).map_err(|e| format!("{shown}: not UTF-8 text ({e})"))?;
            encode_all(&load_tokenizer(t)?, [text.as_str()].into_iter(), false)
        }
        (_, None) => Ok(bytes.into_iter().map(u32::from).collect()),
    }
}

/// llm.c's format (header, then uint16 tokens, or uint32 in its version 2) or nanoGPT's raw
/// uint16 tokens, told apart by the header's magic.
pub fn binary_tokens(bytes: &[u8]) -> Result<Vec<u32>, String> {
    let word = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    if bytes.len() >= LLMC_HEADER_BYTES && word(0) == LLMC_MAGIC {
        let (version, count) = (word(1), word(2));
        let width = match version {
            1 => 2,
            2 => 4,
            v => return Err(format!("llm.c .bin version {v} (1 and 2 are read)")),
        };
        let body = &bytes[LLMC_HEADER_BYTES..];
        let count = usize::try_from(count).map_err(|_| format!("header says {count} tokens"))?;
        if body.len() != count * width {
            return Err(format!(
                "llm.c .bin header says {count} tokens of {width} bytes, the file holds {} bytes \
                 after its header",
                body.len()
            ));
        }
        return Ok(words(body, width));
    }
    if bytes.len() % 2 != 0 {
        return Err(format!(
            "{} bytes: neither llm.c's .bin (magic {LLMC_MAGIC}) nor nanoGPT's uint16 tokens \
             (an even number of bytes)",
            bytes.len()
        ));
    }
    Ok(words(bytes, 2))
}

fn words(bytes: &[u8], width: usize) -> Vec<u32> {
    bytes
        .chunks_exact(width)
        .map(|c| match width {
            2 => u32::from(u16::from_le_bytes([c[0], c[1]])),
            _ => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        })
        .collect()
}

/// The `text` of each line of a JSON-lines file (blank lines skipped).
fn documents(bytes: &[u8]) -> Result<Vec<String>, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8 ({e})"))?;
    let mut docs = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("line {}: not JSON: {e}", n + 1))?;
        match v.get("text").and_then(|t| t.as_str()) {
            Some(t) => docs.push(t.to_string()),
            None => return Err(format!("line {}: no \"text\" string", n + 1)),
        }
    }
    Ok(docs)
}

fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, String> {
    tokenizers::Tokenizer::from_file(path)
        .map_err(|e| format!("--tokenizer {}: {e}", path.display()))
}

/// End-of-text tokens tokenizers commonly name.
const EOS_NAMES: [&str; 4] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"];

/// Every document's tokens, joined by the end-of-text token when `join`.
fn encode_all<'a>(
    tok: &tokenizers::Tokenizer,
    docs: impl Iterator<Item = &'a str>,
    join: bool,
) -> Result<Vec<u32>, String> {
    let eos = if join {
        Some(
            EOS_NAMES
                .iter()
                .find_map(|n| tok.token_to_id(n))
                .ok_or_else(|| {
                    format!(
                        "the tokenizer has no end-of-text token to join documents with (looked \
                         for {})",
                        EOS_NAMES.join(", ")
                    )
                })?,
        )
    } else {
        None
    };
    let mut out = Vec::new();
    for doc in docs {
        let enc = tok
            .encode(doc, false)
            .map_err(|e| format!("--tokenizer: {e}"))?;
        out.extend_from_slice(enc.get_ids());
        out.extend(eos);
    }
    Ok(out)
}

/// At least one sample, every token inside the vocabulary; `what` (`--data FILE`) names the
/// data in messages.
pub fn check(what: &str, tokens: &[u32], vocab: u64, seq: usize) -> Result<(), String> {
    if let Some(at) = tokens.iter().position(|&t| u64::from(t) >= vocab) {
        return Err(format!(
            "{what}: token {} at position {at} is outside the model's vocabulary of {vocab}",
            tokens[at]
        ));
    }
    if tokens.len() <= seq + 1 {
        return Err(format!(
            "{what}: {} tokens are fewer than one sample of {} tokens",
            tokens.len(),
            seq + 1
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llmc(version: i32, tokens: &[u32]) -> Vec<u8> {
        let mut header = vec![0i32; 256];
        header[0] = LLMC_MAGIC;
        header[1] = version;
        header[2] = tokens.len() as i32;
        let mut out: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
        for &t in tokens {
            if version == 1 {
                out.extend((t as u16).to_le_bytes());
            } else {
                out.extend(t.to_le_bytes());
            }
        }
        out
    }

    #[test]
    fn llm_c_and_nanogpt_binaries_read_as_their_tokens() {
        assert_eq!(
            binary_tokens(&llmc(1, &[5, 65535, 7])).unwrap(),
            [5, 65535, 7]
        );
        assert_eq!(
            binary_tokens(&llmc(2, &[5, 128_000])).unwrap(),
            [5, 128_000]
        );
        let nano: Vec<u8> = [1u16, 2, 50256]
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect();
        assert_eq!(binary_tokens(&nano).unwrap(), [1, 2, 50256]);
        let mut short = llmc(1, &[1, 2, 3]);
        short.pop();
        assert!(binary_tokens(&short)
            .unwrap_err()
            .contains("header says 3 tokens"));
        assert!(binary_tokens(&[1, 2, 3]).unwrap_err().contains("neither"));
    }

    #[test]
    fn a_token_outside_the_vocabulary_is_named_with_its_position() {
        let err = check("--data d.bin", &[1, 2, 300, 4, 5], 256, 2).unwrap_err();
        assert!(err.contains("token 300 at position 2"), "{err}");
        assert!(check("d.bin", &[1, 2, 3], 256, 2)
            .unwrap_err()
            .contains("fewer"));
    }

    #[test]
    fn a_label_with_a_tokenizer_reads_back() {
        let l = label("a b.jsonl", Some(Path::new("t/tok.json")));
        assert_eq!(
            parse_label(&l),
            ("a b.jsonl", Some(Path::new("t/tok.json")))
        );
        assert_eq!(parse_label("plain.txt"), ("plain.txt", None));
    }
}
