//! The dashboard's lifeline to each worker process it starts: a pipe whose write end only the
//! dashboard holds, whose read end the worker watches (`train --supervisor-fd=N`).
//!
//! Whatever way the dashboard ends — quit, crash, SIGKILL, its terminal closed — the kernel
//! closes the write end, and the worker, reading end-of-file, stops as on SIGTERM: it finishes
//! its step, checkpoints and exits. No orphan trains on unseen. A dashboard that detaches
//! writes [`DETACH`] first: the worker then runs on alone (in its own process group, so the
//! terminal's signals do not reach it) until it is stopped with SIGTERM, by `x` in a later
//! dashboard or by `kill`. Unlike `PR_SET_PDEATHSIG`, which only the child can clear, this
//! leaves the choice to the dashboard until the moment it leaves.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::io::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::process::Command;

/// What a detaching dashboard writes before it lets go.
pub const DETACH: &[u8] = b"detach\n";

/// The dashboard's end of one worker's lifeline.
#[derive(Debug)]
pub struct Lifeline {
    writer: File,
}

impl Lifeline {
    /// A new lifeline and its read end, for one child: pass it with [`inherit`].
    pub fn new() -> std::io::Result<(Lifeline, OwnedFd)> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2 writes two descriptors into the array it is given; both are new and
        // owned by this process from here on.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fds[0] and fds[1] were just opened by pipe2 and nothing else owns them.
        let (reader, writer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        Ok((Lifeline { writer }, reader))
    }

    /// Tell the worker it is on its own, then let go of the line.
    pub fn detach(mut self) {
        let _ = self.writer.write_all(DETACH);
    }
}

/// Let the child that `cmd` starts inherit descriptor `fd` under the same number (every
/// descriptor this process opens is close-on-exec; this clears the flag in the child only).
pub fn inherit(cmd: &mut Command, fd: RawFd) {
    use std::os::unix::process::CommandExt;
    // SAFETY: fcntl is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// How a watched lifeline ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The dashboard detached: the worker runs on alone.
    Detached,
    /// The dashboard is gone without detaching.
    Gone,
}

/// The worker's side: take descriptor `fd` (given on its command line) as a lifeline's read
/// end, refusing one that is not an open pipe.
pub fn adopt(fd: RawFd) -> std::io::Result<File> {
    // SAFETY: fstat only writes the struct it is given.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if fd < 3 || unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::other(format!(
            "--supervisor-fd {fd} is not an open descriptor"
        )));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFIFO {
        return Err(std::io::Error::other(format!(
            "--supervisor-fd {fd} is not a pipe"
        )));
    }
    // SAFETY: an open pipe descriptor passed to this process for it alone to read; it is
    // marked close-on-exec again so that nothing this process starts inherits it.
    let file = unsafe { File::from_raw_fd(fd) };
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(file)
}

/// Block until the dashboard detaches or is gone.
pub fn watch(mut line: File) -> Ended {
    let mut said = Vec::new();
    let mut buf = [0u8; 64];
    loop {
        match line.read(&mut buf) {
            Ok(0) => return Ended::Gone,
            Ok(n) => {
                said.extend_from_slice(&buf[..n]);
                if said.windows(DETACH.len()).any(|w| w == DETACH) {
                    return Ended::Detached;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return Ended::Gone,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watched(end: impl FnOnce(Lifeline)) -> Ended {
        let (line, reader) = Lifeline::new().unwrap();
        let watcher = std::thread::spawn(move || watch(File::from(reader)));
        end(line);
        watcher.join().unwrap()
    }

    #[test]
    fn a_dashboard_that_goes_without_a_word_is_gone_and_one_that_detaches_is_not() {
        assert_eq!(watched(drop), Ended::Gone);
        assert_eq!(watched(Lifeline::detach), Ended::Detached);
    }

    #[test]
    fn only_a_pipe_is_adopted() {
        let file = tempfile::tempfile().unwrap();
        let err = adopt(file.as_raw_fd()).unwrap_err().to_string();
        assert!(err.contains("is not a pipe"), "{err}");
        assert!(adopt(1_000_000).is_err());
    }
}
