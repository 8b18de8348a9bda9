//! One process at a time in a directory (a checkpoint directory, a run directory): a lock file
//! in it names the holder — pid, process start time, host — and is held with `flock` while the
//! holder lives. A second process is refused with the holder's name; a lock left by a process
//! that is gone (or whose pid now belongs to a process started later) is taken over, with a
//! note saying so. A holder may hand its lock to a child that inherited the lock file (a
//! dashboard to the worker it starts), and anyone may read who holds a lock ([`owner`]).

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
        format!(" on host {}", osdp_core::text::printable(host))
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
        Holder::of(std::process::id()).unwrap_or(Holder {
            pid: std::process::id(),
            start_ticks: 0,
            started: started_text(0),
            host: this_host(),
        })
    }

    /// This machine's process `pid`, when it exists.
    fn of(pid: u32) -> Option<Holder> {
        let (start_ticks, _) = process_start(pid)?;
        Some(Holder {
            pid,
            start_ticks,
            started: started_text(start_ticks),
            host: this_host(),
        })
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
    /// Whether dropping it removes the lock file (not after [`DirLock::hand_over`]).
    remove_on_drop: bool,
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
                    osdp_core::text::printable(&h.started)
                )),
                None => None,
            };
            write_holder(&file, &Holder::me()).map_err(io)?;
            let lock = DirLock {
                path,
                file,
                remove_on_drop: true,
            };
            return Ok((lock, note));
        }
        Err(io(std::io::Error::other(
            "the lock file keeps changing under this process",
        )))
    }
}

impl DirLock {
    /// Name this machine's process `pid` as the holder. It must have the lock file open
    /// (a child that inherited [`DirLock::as_raw_fd`]): the flock is shared by every
    /// descriptor of the open file, so the lock lives as long as that process does.
    pub fn name_holder(&self, pid: u32) -> std::io::Result<()> {
        let holder = Holder::of(pid)
            .ok_or_else(|| std::io::Error::other(format!("no process {pid} to hold the lock")))?;
        write_holder(&self.file, &holder)
    }

    /// Let go of the lock without removing it: the process named by
    /// [`DirLock::name_holder`] holds it from now on, and its end releases it.
    pub fn hand_over(mut self) {
        self.remove_on_drop = false;
    }
}

#[cfg(unix)]
impl std::os::unix::io::AsRawFd for DirLock {
    /// The lock file's descriptor, for a child process to inherit.
    fn as_raw_fd(&self) -> std::os::unix::io::RawFd {
        self.file.as_raw_fd()
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Remove the file while still holding it, so that whoever opens the path next finds
        // no lock or a fresh one; closing the file then releases the flock.
        if self.remove_on_drop && is_same_file(&self.file, &self.path) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A directory's lock as someone who does not hold it sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LockOwner {
    pub pid: u32,
    /// The holder's machine (empty when the record does not say).
    pub host: String,
    /// When the holder started, UTC.
    pub started: String,
    /// Whether the holder is this machine's process (only then can it be signalled).
    pub local: bool,
    /// Whether the holder still holds the lock: on this machine, the process with that pid and
    /// start time runs; on another, the lock file's flock is held.
    pub alive: bool,
}

impl std::fmt::Display for LockOwner {
    /// `pid N on HOST since T`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let host = if self.host.is_empty() {
            "this machine".into()
        } else {
            osdp_core::text::printable(&self.host)
        };
        let started = osdp_core::text::printable(&self.started);
        write!(f, "pid {} on {host} since {started}", self.pid)
    }
}

/// What a directory's lock file says, read without taking the lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockState {
    /// No lock file.
    Absent,
    /// The record of who holds (or held) the lock.
    Named(LockOwner),
    /// A lock file that names no one: `problem` says what it is instead (`PATH is empty`,
    /// `PATH is a directory`, ...); `held`: whether a process holds its flock (or may: a file
    /// this user cannot read cannot be told).
    Unnamed { problem: String, held: bool },
}

impl LockState {
    /// Whether a process holds the lock (or may).
    pub fn is_live(&self) -> bool {
        match self {
            LockState::Absent => false,
            LockState::Named(o) => o.alive,
            LockState::Unnamed { held, .. } => *held,
        }
    }
}

/// Who holds `dir`'s lock, read without taking it; `None` when there is no lock file or no
/// record in it.
pub fn owner(dir: &Path) -> Option<LockOwner> {
    match state(dir) {
        LockState::Named(o) => Some(o),
        _ => None,
    }
}

/// What `dir`'s lock file says, read without taking it. A lock file that is not a regular
/// file (a directory, a symlink) is one no process can hold: [`DirLock::acquire`] refuses it.
pub fn state(dir: &Path) -> LockState {
    let path = dir.join(LOCK_FILE);
    let shown = osdp_core::text::printable(&path.display().to_string()).into_owned();
    let unreadable = |e: std::io::Error| LockState::Unnamed {
        problem: format!("{shown} cannot be read ({e})"),
        held: true,
    };
    let not_a_file = |kind: std::fs::FileType| LockState::Unnamed {
        problem: format!("{shown} is {}", super::file_kind(kind)),
        held: false,
    };
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC);
    }
    let file = match options.open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return LockState::Absent,
        Err(e) => {
            return match std::fs::symlink_metadata(&path) {
                Ok(m) if !m.is_file() => not_a_file(m.file_type()),
                _ => unreadable(e),
            }
        }
    };
    let meta = match file.metadata() {
        Ok(m) if m.is_file() => m,
        Ok(m) => return not_a_file(m.file_type()),
        Err(e) => return unreadable(e),
    };
    let Some(h) = read_holder(&file) else {
        // Its holder writes the record while holding the flock: a held lock naming no one is
        // being written.
        let held =
            matches!(flock_shared(&file), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        let what = if meta.len() == 0 {
            "is empty"
        } else {
            "holds no lock record"
        };
        return LockState::Unnamed {
            problem: format!("{shown} {what}"),
            held,
        };
    };
    let local = h.host.is_empty() || h.host == this_host();
    // Another machine's process cannot be looked up: its flock, which it holds while it runs
    // (on a file system that passes flock between machines), says. A shared probe is released
    // as soon as the file closes.
    let alive = if local {
        h.is_running()
    } else {
        !matches!(flock_shared(&file), Ok(()))
    };
    LockState::Named(LockOwner {
        pid: h.pid,
        host: h.host,
        started: h.started,
        local,
        alive,
    })
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
        started: osdp_core::text::printable(&h.started).into_owned(),
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

/// Take `file`'s shared flock without waiting (fails while someone holds it exclusively).
#[cfg(unix)]
fn flock_shared(file: &File) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: as in `flock`.
    match unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

#[cfg(not(unix))]
fn flock_shared(_file: &File) -> std::io::Result<()> {
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
        Some(boot) if hz > 0 && ticks > 0 => osdp_core::units::utc(boot + ticks / hz as u64),
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
    fn a_lock_handed_to_a_child_names_it_while_it_lives_and_outlives_the_hand_over() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(owner(dir.path()), None, "no lock file, no owner");
        let (lock, _) = DirLock::acquire(dir.path(), "run directory").unwrap();
        let me = owner(dir.path()).unwrap();
        assert_eq!(
            (me.pid, me.alive, me.local),
            (std::process::id(), true, true)
        );
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        lock.name_holder(child.id()).unwrap();
        lock.hand_over();
        let held = owner(dir.path()).expect("the file stays after the hand-over");
        assert_eq!((held.pid, held.alive), (child.id(), true));
        assert!(held
            .to_string()
            .starts_with(&format!("pid {} on ", child.id())));
        child.kill().unwrap();
        child.wait().unwrap();
        let gone = owner(dir.path()).unwrap();
        assert_eq!((gone.pid, gone.alive), (child.id(), false));
        // Its lock is taken over like any left by a process that is gone.
        let (_, note) = DirLock::acquire(dir.path(), "run directory").unwrap();
        assert!(note.is_some_and(|n| n.contains("no longer running")));
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
