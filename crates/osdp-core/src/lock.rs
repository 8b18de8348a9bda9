//! One process at a time in a directory (a checkpoint directory now, a run directory later):
//! a lock file in it names the holder — pid, process start time, host — and is held with
//! `flock` while the holder lives. A second process is refused with the holder's name; a lock
//! left by a process that is gone (or whose pid now belongs to a process started later) is
//! taken over, with a note saying so.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The lock file's name inside the locked directory.
pub const LOCK_FILE: &str = ".osdp-tui.lock";
/// Longest lock file read: a record is under 200 bytes.
const MAX_RECORD_BYTES: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{what} {} is in use by pid {pid}{} (started {started})", dir.display(), on_host(host))]
    InUse {
        what: String,
        dir: PathBuf,
        pid: u32,
        host: String,
        started: String,
    },
    #[error("{what} {}: cannot lock {LOCK_FILE}: {source}", dir.display())]
    Io {
        what: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// ` on host h` when `host` is another machine's name, else nothing.
fn on_host(host: &str) -> String {
    if host.is_empty() || host == this_host() {
        String::new()
    } else {
        format!(" on host {}", crate::text::printable(host))
    }
}

/// Who holds a lock, as the lock file records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Holder {
    pid: u32,
    /// Start time in clock ticks since boot (`/proc/PID/stat`, field 22): with the pid, it
    /// names one process even after the pid is reused.
    start_ticks: u64,
    /// The same start, readable (UTC).
    started: String,
    host: String,
}

impl Holder {
    fn me() -> Holder {
        let pid = std::process::id();
        let start_ticks = process_start(pid).map_or(0, |(ticks, _)| ticks);
        Holder {
            pid,
            start_ticks,
            started: started_text(start_ticks),
            host: this_host(),
        }
    }

    /// Whether the process this names is still running (on this machine: on another, it
    /// cannot be told, and the caller decides).
    fn is_running(&self) -> bool {
        process_start(self.pid).is_some_and(|(ticks, live)| live && ticks == self.start_ticks)
    }
}

/// The lock of one directory, held until dropped (or the process ends, however it ends).
#[derive(Debug)]
pub struct DirLock {
    path: PathBuf,
    file: File,
}

impl DirLock {
    /// Lock `dir` (which must exist) for this process; `what` names it in messages
    /// ("checkpoint directory"). Also returns a note when a stale lock was taken over.
    pub fn acquire(dir: &Path, what: &str) -> Result<(DirLock, Option<String>), LockError> {
        let path = dir.join(LOCK_FILE);
        let io = |source: std::io::Error| LockError::Io {
            what: what.to_string(),
            dir: dir.to_path_buf(),
            source,
        };
        // A holder that lets go removes the file: what was opened may no longer be the lock.
        for _ in 0..100 {
            let file = open_lock_file(&path).map_err(io)?;
            let exclusive = match flock(&file) {
                Ok(()) => true,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let holder = read_holder(&file);
                    return Err(in_use(what, dir, holder));
                }
                // A file system without flock: the pid and start time alone decide.
                Err(_) => false,
            };
            if !is_same_file(&file, &path) {
                continue;
            }
            let note = match read_holder(&file) {
                Some(h) if h.host == this_host() && h.is_running() => {
                    return Err(in_use(what, dir, Some(h)))
                }
                // Another machine's process cannot be looked up: its lock is stale only if
                // flock, which that machine's holder would hold, is free.
                Some(h) if h.host != this_host() && !exclusive => {
                    return Err(in_use(what, dir, Some(h)))
                }
                Some(h) => Some(format!(
                    "took over the lock of {what} {} from pid {}{} (started {}), which is no \
                     longer running",
                    dir.display(),
                    h.pid,
                    on_host(&h.host),
                    crate::text::printable(&h.started)
                )),
                None => None,
            };
            write_holder(&file, &Holder::me()).map_err(io)?;
            return Ok((DirLock { path, file }, note));
        }
        Err(io(std::io::Error::other(
            "the lock file keeps changing under this process",
        )))
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Remove the file while still holding it, so that whoever opens the path next finds
        // no lock or a fresh one; closing the file then releases the flock.
        if is_same_file(&self.file, &self.path) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn in_use(what: &str, dir: &Path, holder: Option<Holder>) -> LockError {
    let h = holder.unwrap_or(Holder {
        pid: 0,
        start_ticks: 0,
        started: "at an unknown time".into(),
        host: String::new(),
    });
    LockError::InUse {
        what: what.to_string(),
        dir: dir.to_path_buf(),
        pid: h.pid,
        host: h.host,
        started: crate::text::printable(&h.started).into_owned(),
    }
}

/// Open (creating) the lock file: never through a symlink, never anything but a regular file.
fn open_lock_file(path: &Path) -> std::io::Result<File> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true).write(true).create(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC);
    }
    let file = options.open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    Ok(file)
}

/// Take `file`'s exclusive flock without waiting.
#[cfg(unix)]
fn flock(file: &File) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: flock on a descriptor this process owns; no memory is involved.
    match unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

#[cfg(not(unix))]
fn flock(_file: &File) -> std::io::Result<()> {
    Err(std::io::ErrorKind::Unsupported.into())
}

/// Whether `path` is still the file `file` has open.
fn is_same_file(file: &File, path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (file.metadata(), std::fs::symlink_metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = file;
        path.exists()
    }
}

fn read_holder(mut file: &File) -> Option<Holder> {
    let mut text = String::new();
    file.seek(SeekFrom::Start(0)).ok()?;
    file.take(MAX_RECORD_BYTES).read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

fn write_holder(mut file: &File, holder: &Holder) -> std::io::Result<()> {
    let mut text = serde_json::to_string(holder).map_err(std::io::Error::other)?;
    text.push('\n');
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    file.write_all(text.as_bytes())?;
    file.sync_all()
}

/// Process `pid`'s start time in clock ticks since boot, and whether it still runs (a zombie
/// has ended); `None` when there is no such process.
fn process_start(pid: u32) -> Option<(u64, bool)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state …`: the command name may hold spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?;
    let ticks = fields.get(19)?.parse().ok()?;
    Some((ticks, !matches!(*state, "Z" | "X" | "x")))
}

/// A start time in ticks since boot as a UTC date and time, or "at an unknown time".
fn started_text(ticks: u64) -> String {
    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<u64>().ok())
    });
    // SAFETY: sysconf only reads a system constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    match boot {
        Some(boot) if hz > 0 && ticks > 0 => crate::units::utc(boot + ticks / hz as u64),
        _ => "at an unknown time".into(),
    }
}

fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_with_the_holder_named_and_free_again_after() {
        let dir = tempfile::tempdir().unwrap();
        let (lock, note) = DirLock::acquire(dir.path(), "checkpoint directory").unwrap();
        assert_eq!(note, None);
        let record = std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
        assert!(
            record.contains(&format!("\"pid\":{}", std::process::id())),
            "{record}"
        );
        // Another open file description of the same lock (as another process would have).
        let err = DirLock::acquire(dir.path(), "checkpoint directory").unwrap_err();
        let text = err.to_string();
        let want = format!(
            "checkpoint directory {} is in use by pid {} (started ",
            dir.path().display(),
            std::process::id()
        );
        assert!(text.starts_with(&want), "{text}");
        assert!(text.ends_with(" UTC)"), "{text}");
        drop(lock);
        assert!(
            !dir.path().join(LOCK_FILE).exists(),
            "released locks leave nothing"
        );
        assert!(DirLock::acquire(dir.path(), "checkpoint directory").is_ok());
    }

    #[test]
    fn a_lock_left_by_a_process_that_is_gone_is_taken_over_with_a_note() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let me = Holder::me();
        for (pid, start_ticks) in [
            // A process that has ended.
            (gone, me.start_ticks),
            // This pid, but a start time of another process: the pid was reused.
            (std::process::id(), me.start_ticks + 1),
        ] {
            let stale = Holder {
                pid,
                start_ticks,
                started: "2020-01-01 00:00:00 UTC".into(),
                host: this_host(),
            };
            std::fs::write(
                dir.path().join(LOCK_FILE),
                serde_json::to_string(&stale).unwrap(),
            )
            .unwrap();
            let (lock, note) = DirLock::acquire(dir.path(), "run directory").unwrap();
            let note = note.expect("a note");
            assert!(
                note.contains(&format!("from pid {pid} (started 2020-01-01 00:00:00 UTC)"))
                    && note.contains("no longer running"),
                "{note}"
            );
            drop(lock);
        }
        // Garbage where the record should be is no holder.
        std::fs::write(dir.path().join(LOCK_FILE), "\u{0}\u{1}garbage").unwrap();
        assert!(DirLock::acquire(dir.path(), "run directory").is_ok());
    }

    #[test]
    fn a_symlink_in_place_of_the_lock_file_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, "keep").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join(LOCK_FILE)).unwrap();
        assert!(DirLock::acquire(dir.path(), "run directory").is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
    }
}
