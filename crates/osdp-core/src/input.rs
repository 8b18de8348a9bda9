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
    #[error("{}: larger than {limit} bytes; inputs over that are refused", path.display())]
    TooLarge { path: PathBuf, limit: u64 },
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
    let text = read_text(path, MAX_INPUT_BYTES)?;
    parse_strict(path, &text, supported)
}

/// The text of a regular file of at most `limit` bytes. Anything else is refused before it is
/// read: a FIFO would block until someone writes, `/dev/zero` never ends, and a file's length
/// may change between looking and reading, so the read itself stops at `limit + 1` bytes.
pub fn read_text(path: &Path, limit: u64) -> Result<String, InputError> {
    let io_err = |source| InputError::Io {
        path: path.to_path_buf(),
        source,
    };
    let not_regular = |meta: &std::fs::Metadata| {
        (!meta.is_file()).then(|| {
            io_err(std::io::Error::other(format!(
                "it is {}, not a regular file",
                file_kind(&meta.file_type())
            )))
        })
    };
    if let Some(e) = not_regular(&std::fs::metadata(path).map_err(io_err)?) {
        return Err(e);
    }
    // The handle's own metadata is checked again below; a path swapped for a FIFO between the
    // two looks would block this open, a race only a process already writing here can start.
    let file = std::fs::File::open(path).map_err(io_err)?;
    let meta = file.metadata().map_err(io_err)?;
    if let Some(e) = not_regular(&meta) {
        return Err(e);
    }
    // A file already known to be too large is refused without reading a byte of it.
    if meta.len() > limit {
        return Err(InputError::TooLarge {
            path: path.to_path_buf(),
            limit,
        });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    std::io::Read::read_to_end(&mut std::io::Read::take(file, limit + 1), &mut bytes)
        .map_err(io_err)?;
    if bytes.len() as u64 > limit {
        return Err(InputError::TooLarge {
            path: path.to_path_buf(),
            limit,
        });
    }
    String::from_utf8(bytes).map_err(|e| {
        io_err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "stream did not contain valid UTF-8 (byte {})",
                e.utf8_error().valid_up_to()
            ),
        ))
    })
}

/// `a directory`, `a FIFO`: what a path that is not a regular file is, for messages.
fn file_kind(kind: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return "a FIFO";
        } else if kind.is_socket() {
            return "a socket";
        } else if kind.is_block_device() {
            return "a block device";
        } else if kind.is_char_device() {
            return "a character device";
        }
    }
    if kind.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// [`read_strict`] on text in memory; `path` is only used in messages.
pub fn parse_strict<T: serde::de::DeserializeOwned>(
    path: &Path,
    text: &str,
    supported: u32,
) -> Result<T, InputError> {
    // serde reads a struct from a JSON array too (fields by position): `[{...}]` or `[1, "x", …]`
    // would then pass as a model. Every format here is an object.
    if !text.trim_start().starts_with('{') {
        let (line, column) = text
            .lines()
            .enumerate()
            .find_map(|(l, s)| s.find(|c: char| !c.is_whitespace()).map(|c| (l + 1, c + 1)))
            .unwrap_or((1, 1));
        return Err(InputError::Syntax {
            path: path.to_path_buf(),
            line,
            column,
            field: "(top level)".into(),
            message: "expected a JSON object `{...}`".into(),
        });
    }
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
    let value = serde_path_to_error::deserialize(&mut *de)
        .map_err(|e| InputError::from_serde(path.to_path_buf(), e))?;
    // A second object or any text after the first would otherwise pass unread, the first
    // winning: one file, one object.
    de.end().map_err(|e| InputError::Syntax {
        path: path.to_path_buf(),
        line: e.line(),
        column: e.column(),
        field: "(after the top-level object)".into(),
        message: "trailing text: a file holds one JSON object".into(),
    })?;
    Ok(value)
}

/// Write pretty JSON atomically: temp file beside the target, fsync, rename. An interrupted
/// write never leaves a half file where a good one was.
pub fn write_json_atomically<T: serde::Serialize>(path: &Path, value: &T) -> std::io::Result<()> {
    let mut text = serde_json::to_string_pretty(value).map_err(std::io::Error::other)?;
    text.push('\n');
    write_atomically(path, text.as_bytes())
}

/// Write `bytes` to `path` so that a reader sees the old file or the new one, never half.
///
/// A regular file (or none) is replaced by rename from a temp file beside it. A character
/// device (`-o /dev/null`, `/dev/stdout` on a terminal) is written in place: renaming over it
/// would replace the device node itself. Directories, FIFOs (a write would block until someone
/// reads), sockets and block devices are refused.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let Some((dir, file_name)) = replaceable(path)? else {
        // No truncate: devices have no length, and /dev/stdout may be a file the shell
        // opened for appending.
        return open_device(path)?.write_all(bytes);
    };
    let (tmp, mut f) = create_temp_beside(&dir, &file_name)?;
    let result = (|| {
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Whether [`write_atomically`] can write `path`, asked before the work that makes its content:
/// the target is a regular file or nothing, and a file can be created (and is removed again)
/// beside it; or it is a character device this process may open for writing. Says why not.
pub fn check_writable(path: &Path) -> std::io::Result<()> {
    match replaceable(path)? {
        Some((dir, file_name)) => {
            let (tmp, f) = create_temp_beside(&dir, &file_name)?;
            drop(f);
            std::fs::remove_file(&tmp)
        }
        None => open_device(path).map(drop),
    }
}

/// Where [`write_atomically`] replaces `path` by rename: its directory and file name; `None`
/// when `path` is a character device (written in place); an error for any other kind of file.
fn replaceable(path: &Path) -> std::io::Result<Option<(PathBuf, String)>> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_file() => {}
        Ok(meta) if is_char_device(&meta.file_type()) => return Ok(None),
        Ok(meta) => {
            return Err(std::io::Error::other(format!(
                "it is {}; give a file name",
                file_kind(&meta.file_type())
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("output path has no file name"))?;
    Ok(Some((dir, file_name.to_string_lossy().into_owned())))
}

fn is_char_device(kind: &std::fs::FileType) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        kind.is_char_device()
    }
    #[cfg(not(unix))]
    {
        let _ = kind;
        false
    }
}

/// A character device, opened for writing in place.
fn open_device(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new().write(true).open(path)
}

/// The name of a temp file for `file_name`: `.FILE.tmp-PID-N-NANOS` (this process's pid, a
/// counter, the clock's nanoseconds).
fn temp_name(file_name: &str, counter: u64, nanos: u32) -> String {
    format!(
        ".{file_name}.tmp-{}-{counter}-{nanos:09}",
        std::process::id()
    )
}

/// Whether `name` is a temp file [`write_atomically`] made for `file_name`, as a writer killed
/// before its rename leaves it beside the file.
pub fn is_temp_name_of(name: &str, file_name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix('.')
        .and_then(|n| n.strip_prefix(file_name))
        .and_then(|n| n.strip_prefix(".tmp-"))
    else {
        return false;
    };
    let numbers: Vec<&str> = rest.split('-').collect();
    let digits = |n: &str| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
    numbers.len() == 3 && numbers.iter().all(|n| digits(n)) && numbers[2].len() == 9
}

/// Create a fresh temp file in `dir` for `file_name`. The name is hard to guess and the open
/// refuses any existing entry, a symlink included (`create_new` is `O_CREAT | O_EXCL`, which
/// never follows a link), so a link planted at the temp name cannot redirect the write.
fn create_temp_beside(dir: &Path, file_name: &str) -> std::io::Result<(PathBuf, std::fs::File)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut last_err = None;
    for _ in 0..16 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let tmp = dir.join(temp_name(
            file_name,
            COUNTER.fetch_add(1, Ordering::Relaxed),
            nanos,
        ));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last_err = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last_err.unwrap_or_else(|| std::io::Error::other("no free temp file name")))
}

#[cfg(test)]
mod temp_names {
    use super::*;

    #[test]
    fn a_temp_name_is_recognised_as_of_its_file_and_no_other() {
        let name = temp_name("latest.json", 7, 12);
        assert!(is_temp_name_of(&name, "latest.json"), "{name}");
        assert!(!is_temp_name_of(&name, "manifest.json"));
        for other in [
            "latest.json",
            ".latest.json.tmp-",
            ".latest.json.tmp-1-2-3",
            ".latest.json.tmp-1-2-000000003-4",
            ".latest.json.tmp-a-2-000000003",
            ".latest.json.tmp-1--000000003",
            "latest.json.tmp-1-2-000000003",
        ] {
            assert!(!is_temp_name_of(other, "latest.json"), "{other}");
        }
    }

    #[test]
    fn writability_is_checked_without_leaving_anything() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.json");
        check_writable(&path).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let e = check_writable(dir.path()).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        assert!(check_writable(&dir.path().join("no/such/dir/out.json")).is_err());
        check_writable(Path::new("/dev/null")).unwrap();
    }
}
