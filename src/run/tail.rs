//! Following a run's files as they grow: the worker's log for the log view, the metrics
//! stream for the dashboard and `status --follow`.

use std::path::{Path, PathBuf};

use osdp_core::protocol::WorkerEvent;

/// A line of the worker's log as a reader sees it: of a line a terminal would have redrawn
/// (`\r`, progress), what was drawn last; without the erase-line sequence; `None` when blank.
pub fn log_line(raw: &str) -> Option<String> {
    let shown = raw.rsplit('\r').next().unwrap_or(raw);
    let shown = shown.trim_end_matches('\n').replace("\u{1b}[2K", "");
    (!shown.trim().is_empty()).then_some(shown)
}

/// Follows the worker's log as it grows and keeps its last lines, cleaned by [`log_line`], for
/// the dashboard's log view. A long log already there is read from its last [`LogTail::KEEP`]
/// lines' worth of bytes, not whole.
#[derive(Debug)]
pub struct LogTail {
    path: PathBuf,
    offset: u64,
    partial: String,
    lines: std::collections::VecDeque<String>,
    current: Option<String>,
    /// Lines dropped from the front (past [`LogTail::KEEP`]): line `i` is the log's line
    /// `dropped + i` of those read.
    dropped: u64,
    /// Started in the middle of the log: the first line read is cut.
    cut: bool,
}

impl LogTail {
    /// Lines kept; older ones are dropped.
    pub const KEEP: usize = 5_000;
    /// Bytes read of a log that is already long when the tail starts.
    const FIRST_READ_BYTES: u64 = 1 << 20;

    pub fn new(path: PathBuf) -> LogTail {
        let offset = std::fs::metadata(&path)
            .map(|m| m.len().saturating_sub(Self::FIRST_READ_BYTES))
            .unwrap_or(0);
        LogTail {
            path,
            offset,
            partial: String::new(),
            lines: std::collections::VecDeque::new(),
            current: None,
            dropped: 0,
            cut: offset > 0,
        }
    }

    /// Read what the log gained; how many whole lines that added.
    pub fn read_new(&mut self) -> usize {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return 0;
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        if len < self.offset {
            // Truncated or replaced: start again.
            self.offset = 0;
            self.partial.clear();
        }
        if len == self.offset || f.seek(SeekFrom::Start(self.offset)).is_err() {
            return 0;
        }
        let mut buf = Vec::new();
        let Ok(n) = f.read_to_end(&mut buf) else {
            return 0;
        };
        self.offset += n as u64;
        self.partial.push_str(&String::from_utf8_lossy(&buf));
        let mut added = 0;
        while let Some(nl) = self.partial.find('\n') {
            let raw: String = self.partial.drain(..=nl).collect();
            if std::mem::take(&mut self.cut) {
                continue;
            }
            if let Some(line) = log_line(&raw) {
                if self.lines.len() == Self::KEEP {
                    self.lines.pop_front();
                    self.dropped += 1;
                }
                self.lines.push_back(line);
                added += 1;
            }
        }
        // A line redrawn for ever (a progress bar) keeps only what was drawn last.
        if self.partial.len() > 1 << 16 {
            if let Some(cr) = self.partial.rfind('\r') {
                self.partial.drain(..cr);
            }
        }
        self.current = log_line(&self.partial).filter(|_| !self.cut);
        added
    }

    /// Lines on hand: the whole lines kept and the line being written (a progress line the
    /// worker redraws), if any.
    pub fn len(&self) -> usize {
        self.lines.len() + usize::from(self.current.is_some())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Line `i` of [`LogTail::len`], oldest first.
    pub fn get(&self, i: usize) -> Option<&str> {
        match self.lines.get(i) {
            Some(l) => Some(l),
            None if i == self.lines.len() => self.current.as_deref(),
            None => None,
        }
    }

    /// Lines dropped from the front so far: with [`LogTail::get`], a position in the log that
    /// stays put as lines come and go.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A process killed mid-line leaves a cut line at the end of `path`: end it, through `f` (open
/// for appending), so the next event starts on a line of its own instead of being swallowed by
/// the broken one.
pub fn end_cut_line(path: &Path, f: &mut std::fs::File) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut last = [0u8; 1];
    let cut = std::fs::File::open(path)
        .and_then(|mut r| {
            if r.seek(SeekFrom::End(0))? == 0 {
                return Ok(false);
            }
            r.seek(SeekFrom::End(-1))?;
            r.read_exact(&mut last)?;
            Ok(last[0] != b'\n')
        })
        .unwrap_or(false);
    if cut {
        f.write_all(b"\n")?;
    }
    Ok(())
}

/// Follows a metrics stream as it grows: each read returns the events of the lines completed
/// since the last one (a line still being written waits for its end). A stream truncated,
/// rewritten or replaced (another file renamed over it) is read again from its start.
#[derive(Debug)]
pub struct MetricsTail {
    path: PathBuf,
    offset: u64,
    partial: String,
    /// The file read last time, to tell another one in its place.
    seen: Option<Seen>,
}

/// Which file a [`MetricsTail`] read: its device and inode, and its first bytes.
#[derive(Debug)]
struct Seen {
    id: Option<(u64, u64)>,
    head: Vec<u8>,
}

/// What one read of a [`MetricsTail`] found.
#[derive(Debug, Default)]
pub struct Fresh {
    /// When the file is not the one read before, why; the events are then the new file's,
    /// from its start.
    pub reread: Option<Reread>,
    pub events: Vec<WorkerEvent>,
}

/// Why a stream is read again from its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reread {
    /// Shorter than what was read of it.
    Truncated,
    /// Its first bytes changed (truncated and written again past where it was read to).
    Rewritten,
    /// Another file in its place (a new device or inode).
    Replaced,
}

impl Reread {
    pub fn text(self) -> &'static str {
        match self {
            Reread::Truncated => "truncated",
            Reread::Rewritten => "rewritten",
            Reread::Replaced => "replaced",
        }
    }
}

impl MetricsTail {
    /// Bytes of the stream's start kept to tell a rewritten stream: the `started` line and the
    /// first steps, whose timings differ from run to run.
    const HEAD_BYTES: u64 = 4096;

    /// From byte `offset` of the stream at `path` (0: from the start).
    pub fn new(path: PathBuf, offset: u64) -> MetricsTail {
        MetricsTail {
            path,
            offset,
            partial: String::new(),
            seen: None,
        }
    }

    /// The events written since the last read; none when the file is missing or unreadable.
    /// Lines that do not parse are skipped, as [`RunStatus::from_text`] skips them.
    pub fn read_new(&mut self) -> Vec<WorkerEvent> {
        self.read().map(|f| f.events).unwrap_or_default()
    }

    /// The events written since the last read, and whether the file was read again from its
    /// start. An error when the stream cannot be read: missing (`NotFound`), not a regular
    /// file, unreadable.
    pub fn read(&mut self) -> std::io::Result<Fresh> {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(&self.path)?;
        let meta = f.metadata()?;
        if !meta.is_file() {
            return Err(std::io::Error::other(format!(
                "it is {}, not a file",
                super::file_kind(meta.file_type())
            )));
        }
        let reread = self.check_same(&mut f, &meta)?;
        if reread.is_some() {
            self.offset = 0;
            self.partial.clear();
        }
        f.seek(SeekFrom::Start(self.offset))?;
        let mut buf = Vec::new();
        let n = f.read_to_end(&mut buf)?;
        self.offset += n as u64;
        self.partial.push_str(&String::from_utf8_lossy(&buf));
        let mut events = Vec::new();
        while let Some(nl) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=nl).collect();
            if let Ok(ev) = serde_json::from_str::<WorkerEvent>(line.trim_end()) {
                events.push(ev);
            }
        }
        // A last line without its newline is whole when it parses: a JSON object has no
        // complete prefix.
        if let Ok(ev) = serde_json::from_str::<WorkerEvent>(&self.partial) {
            events.push(ev);
            self.partial.clear();
        }
        Ok(Fresh { reread, events })
    }

    /// Whether `f` (just opened, at its start) is still the file read before, and if not why;
    /// remembers it as the file read.
    fn check_same(
        &mut self,
        f: &mut std::fs::File,
        meta: &std::fs::Metadata,
    ) -> std::io::Result<Option<Reread>> {
        use std::io::Read;
        #[cfg(unix)]
        let id = {
            use std::os::unix::fs::MetadataExt;
            Some((meta.dev(), meta.ino()))
        };
        #[cfg(not(unix))]
        let id = None;
        let mut head = Vec::new();
        f.by_ref().take(Self::HEAD_BYTES).read_to_end(&mut head)?;
        let reread = match &self.seen {
            Some(seen) if seen.id != id => Some(Reread::Replaced),
            _ if meta.len() < self.offset => Some(Reread::Truncated),
            Some(seen) if !head.starts_with(&seen.head) && !seen.head.starts_with(&head) => {
                Some(Reread::Rewritten)
            }
            _ => None,
        };
        let longer = self.seen.as_ref().is_none_or(|s| head.len() > s.head.len());
        if reread.is_some() || longer {
            self.seen = Some(Seen { id, head });
        }
        Ok(reread)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_tail_follows_whole_lines_and_shows_the_one_being_redrawn() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("worker.log");
        let mut f = std::fs::File::create(&path).unwrap();
        let mut tail = LogTail::new(path.clone());
        assert_eq!(tail.read_new(), 0);
        assert!(tail.is_empty());
        write!(f, "training m\n\n\x1b[2Kstep 1\r\x1b[2Kstep 2").unwrap();
        assert_eq!(
            tail.read_new(),
            1,
            "one whole line; the blank one is skipped"
        );
        assert_eq!(tail.len(), 2);
        assert_eq!(tail.get(0), Some("training m"));
        assert_eq!(
            tail.get(1),
            Some("step 2"),
            "what a terminal would show now"
        );
        writeln!(f, "\r\x1b[2Kcheckpoint c/step-2").unwrap();
        assert_eq!(tail.read_new(), 1);
        let lines: Vec<_> = (0..tail.len()).filter_map(|i| tail.get(i)).collect();
        assert_eq!(lines, ["training m", "checkpoint c/step-2"]);
        // Never more than KEEP lines; the newest stay.
        for i in 0..LogTail::KEEP + 10 {
            writeln!(f, "line {i}").unwrap();
        }
        tail.read_new();
        assert_eq!(tail.len(), LogTail::KEEP);
        assert_eq!(tail.dropped(), 12);
        assert_eq!(
            tail.get(LogTail::KEEP - 1).map(str::to_owned),
            Some(format!("line {}", LogTail::KEEP + 9))
        );
    }

    #[test]
    fn the_metrics_tail_reads_a_truncated_rewritten_or_replaced_stream_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let stopped =
            |step: u64| format!("{{\"event\":\"stopped\",\"step\":{step},\"reason\":\"x\"}}\n");
        let steps = |fresh: Fresh| -> (Option<Reread>, Vec<u64>) {
            let steps = fresh.events.iter().map(|ev| match ev {
                WorkerEvent::Stopped { step, .. } => *step,
                _ => unreachable!(),
            });
            (fresh.reread, steps.collect())
        };
        let mut tail = MetricsTail::new(path.clone(), 0);
        assert_eq!(
            tail.read().unwrap_err().kind(),
            std::io::ErrorKind::NotFound
        );
        std::fs::write(&path, stopped(1) + &stopped(2)).unwrap();
        assert_eq!(steps(tail.read().unwrap()), (None, vec![1, 2]));
        std::fs::write(&path, stopped(3)).unwrap();
        assert_eq!(
            steps(tail.read().unwrap()),
            (Some(Reread::Truncated), vec![3])
        );
        std::fs::write(&path, stopped(4) + &stopped(5)).unwrap();
        assert_eq!(
            steps(tail.read().unwrap()),
            (Some(Reread::Rewritten), vec![4, 5])
        );
        let new = dir.path().join("new");
        std::fs::write(&new, stopped(4) + &stopped(5) + &stopped(6)).unwrap();
        std::fs::rename(&new, &path).unwrap();
        assert_eq!(
            steps(tail.read().unwrap()),
            (Some(Reread::Replaced), vec![4, 5, 6])
        );
        assert_eq!(steps(tail.read().unwrap()), (None, vec![]));
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert_eq!(
            tail.read().unwrap_err().to_string(),
            "it is a directory, not a file"
        );
    }
}
