//! Reading the project's strict JSON inputs (model descriptions, layouts, plans): one error type
//! worded for the person who has to fix the file, and atomic writes.

use std::io::Write;
use std::path::Path;

use std::path::PathBuf;

/// Where in the description a semantic problem sits, and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// `op "h0.attn.qkv" (ops[5])`, `config.hidden`, `model`.
    pub at: String,
    pub message: String,
}

impl Problem {
    pub fn op(index: usize, id: &str, message: impl Into<String>) -> Self {
        Problem {
            at: format!("op {id:?} (ops[{index}])"),
            message: message.into(),
        }
    }

    pub fn field(field: &str, message: impl Into<String>) -> Self {
        Problem {
            at: field.to_string(),
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.at, self.message)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: file is {bytes} bytes; inputs over {limit} bytes are refused", path.display())]
    TooLarge {
        path: PathBuf,
        bytes: u64,
        limit: u64,
    },
    /// The JSON does not parse into the format: truncated, wrong type, unknown or missing field.
    #[error("{}:{line}:{column}: {field}: {message}", path.display())]
    Syntax {
        path: PathBuf,
        line: usize,
        column: usize,
        /// Path of the offending field, e.g. `ops[3].params[0].shape`.
        field: String,
        message: String,
    },
    #[error("{}: format version {found} is not supported (this build reads version {supported})", path.display())]
    Version {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    /// Well-formed JSON describing something impossible (a graph with a cycle, a negative bandwidth).
    #[error("{}: {problem}", path.display())]
    Invalid { path: PathBuf, problem: Problem },
}

impl InputError {
    /// Turn a serde error into a `Syntax` error that names file, line:column and field.
    pub(crate) fn from_serde(
        path: PathBuf,
        err: serde_path_to_error::Error<serde_json::Error>,
    ) -> Self {
        let field = match err.path().to_string() {
            p if p == "." => "(top level)".to_string(),
            p => p,
        };
        let inner = err.inner();
        let (line, column) = (inner.line(), inner.column());
        let mut message = inner.to_string();
        // serde_json appends " at line L column C"; we print the position up front instead.
        if let Some(cut) = message.rfind(" at line ") {
            message.truncate(cut);
        }
        InputError::Syntax {
            path,
            line,
            column,
            field,
            message,
        }
    }
}

/// Inputs larger than this are refused before parsing (a 2,000-op graph is about 1 MB).
pub const MAX_INPUT_BYTES: u64 = 256 << 20;

/// Read a JSON file into `T` strictly. When the file carries a `version` other than
/// `supported`, say that rather than tripping on its first unfamiliar field.
pub fn read_strict<T: serde::de::DeserializeOwned>(
    path: &Path,
    supported: u32,
) -> Result<T, InputError> {
    let io_err = |source| InputError::Io {
        path: path.to_path_buf(),
        source,
    };
    let bytes = std::fs::metadata(path).map_err(io_err)?.len();
    if bytes > MAX_INPUT_BYTES {
        return Err(InputError::TooLarge {
            path: path.to_path_buf(),
            bytes,
            limit: MAX_INPUT_BYTES,
        });
    }
    let text = std::fs::read_to_string(path).map_err(io_err)?;
    parse_strict(path, &text, supported)
}

/// [`read_strict`] on text in memory; `path` is only used in messages.
pub fn parse_strict<T: serde::de::DeserializeOwned>(
    path: &Path,
    text: &str,
    supported: u32,
) -> Result<T, InputError> {
    #[derive(serde::Deserialize)]
    struct VersionOnly {
        version: u32,
    }
    if let Ok(v) = serde_json::from_str::<VersionOnly>(text) {
        if v.version != supported {
            return Err(InputError::Version {
                path: path.to_path_buf(),
                found: v.version,
                supported,
            });
        }
    }
    let de = &mut serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| InputError::from_serde(path.to_path_buf(), e))
}

/// Write pretty JSON atomically: temp file beside the target, fsync, rename. An interrupted
/// write never leaves a half file where a good one was.
pub fn write_json_atomically<T: serde::Serialize>(path: &Path, value: &T) -> std::io::Result<()> {
    let mut text = serde_json::to_string_pretty(value).map_err(std::io::Error::other)?;
    text.push('\n');
    write_atomically(path, text.as_bytes())
}

pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("output path has no file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
