//! Stateful interpreter contexts, like notebook kernels: a long-lived `python3` or
//! `bash` process per named context runs cells one at a time and keeps its variables
//! between them.
//!
//! Each interpreter runs a small driver (embedded below) that reads cells from its
//! standard input and answers on its standard output; the driver first moves those to
//! private descriptors so a cell's own output cannot corrupt the exchange. A timeout
//! sends SIGINT (Python raises `KeyboardInterrupt`; the context survives); an
//! interpreter that still does not answer is killed and its context discarded.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use serde::Deserialize;

use crate::exec::ProcessDefaults;
use crate::protocol::{
    CodeError, CodeResult, ContextInfo, ErrorCode, ErrorReply, Language, RichOutput,
};
use crate::reaper::{ChildStatus, Reaper, ReaperError};

/// How long an interrupted cell has to answer before its interpreter is killed.
const INTERRUPT_GRACE: Duration = Duration::from_secs(3);

/// Contexts alive at once.
const MAX_CONTEXTS: usize = 32;

/// The most output kept per stream and cell, in bytes (longer output is cut).
const OUTPUT_LIMIT: usize = 1 << 20;

/// Cells wait this long at most when they have no timeout of their own.
const NO_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// The Python driver: reads one JSON request a line, answers one JSON reply a line.
const PYTHON_DRIVER: &str = r#"
import ast, io, json, os, signal, sys, tempfile, traceback
_proto_in = os.fdopen(os.dup(0), 'r', encoding='utf-8', newline='\n')
_proto_out = os.fdopen(os.dup(1), 'w', encoding='utf-8')
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
_INT = {signal.SIGINT}
# SIGINT is only let through while a cell runs; one that arrives late is discarded.
signal.pthread_sigmask(signal.SIG_BLOCK, _INT)
_LIMIT = int(os.environ.pop('CUBE_OUTPUT_LIMIT', '1048576'))
_ns = {'__name__': '__main__', '__builtins__': __builtins__}

def _clip(s):
    return s if len(s) <= _LIMIT else s[:_LIMIT] + '\n[output truncated]\n'

def _rich(value):
    out = []
    for mime, meth in (('image/png', '_repr_png_'), ('text/html', '_repr_html_'),
                       ('image/svg+xml', '_repr_svg_')):
        f = getattr(value, meth, None)
        if not callable(f):
            continue
        try:
            data = f()
        except Exception:
            continue
        if data is None:
            continue
        if isinstance(data, str):
            data = data.encode('utf-8')
        out.append([mime, bytes(data).hex()])
    if (not any(m == 'image/png' for m, _ in out) and hasattr(value, 'savefig')
            and type(value).__module__.startswith('matplotlib')):
        buf = io.BytesIO()
        value.savefig(buf, format='png')
        out.append(['image/png', buf.getvalue().hex()])
    return out

def _figures():
    plt = sys.modules.get('matplotlib.pyplot')
    if plt is None:
        return []
    out = []
    for num in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(num).savefig(buf, format='png')
        out.append(['image/png', buf.getvalue().hex()])
    plt.close('all')
    return out

def _run(code):
    reply = {'value': None, 'rich': [], 'error': None}
    out, err = io.StringIO(), io.StringIO()
    cap = tempfile.TemporaryFile()
    saved = (os.dup(1), os.dup(2))
    os.dup2(cap.fileno(), 1)
    os.dup2(cap.fileno(), 2)
    real = (sys.stdout, sys.stderr)
    sys.stdout, sys.stderr = out, err
    try:
        has_value, value = False, None
        try:
            if signal.SIGINT in signal.sigpending():
                signal.sigwait(_INT)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _INT)
            try:
                tree = ast.parse(code, '<cell>', 'exec')
                last = None
                if tree.body and isinstance(tree.body[-1], ast.Expr):
                    last = ast.Expression(tree.body.pop().value)
                exec(compile(tree, '<cell>', 'exec'), _ns)
                if last is not None:
                    value = eval(compile(last, '<cell>', 'eval'), _ns)
                    has_value = True
            finally:
                signal.pthread_sigmask(signal.SIG_BLOCK, _INT)
        except BaseException as e:
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != '<cell>':
                tb = tb.tb_next
            reply['error'] = {
                'name': type(e).__name__,
                'value': str(e),
                'traceback': ''.join(traceback.format_exception(type(e), e, tb)),
            }
        if has_value and value is not None:
            _ns['_'] = value
            try:
                reply['value'] = _clip(repr(value))
            except BaseException as e:
                reply['value'] = '<repr failed: %s>' % type(e).__name__
            try:
                reply['rich'] = _rich(value)
            except BaseException:
                pass
        try:
            reply['rich'] += _figures()
        except BaseException:
            pass
    finally:
        sys.stdout, sys.stderr = real
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    cap.seek(0)
    raw = cap.read(_LIMIT + 1).decode('utf-8', 'replace')
    cap.close()
    reply['stdout'] = _clip(out.getvalue() + raw)
    reply['stderr'] = _clip(err.getvalue())
    return reply

while True:
    line = _proto_in.readline()
    if not line:
        break
    try:
        reply = _run(json.loads(line)['code'])
    except BaseException as e:
        reply = {'stdout': '', 'stderr': '', 'value': None, 'rich': [],
                 'error': {'name': type(e).__name__, 'value': str(e), 'traceback': ''}}
    _proto_out.write(json.dumps(reply) + '\n')
    _proto_out.flush()
"#;

/// The bash driver: a cell is its lines followed by an end-marker line; the answer is
/// the status of the cell's last command; output goes to files in the context's dir.
const BASH_DRIVER: &str = r#"
exec 3<&0 4>&1 </dev/null
__cube_dir=$CUBE_CTX_DIR; __cube_end=$CUBE_END; unset CUBE_CTX_DIR CUBE_END
trap ':' INT
while :; do
  __cube_code=
  while :; do
    IFS= read -r __cube_line <&3
    __cube_rc=$?
    if [ "$__cube_rc" -gt 128 ]; then continue; fi
    if [ "$__cube_rc" -ne 0 ]; then exit 0; fi
    [ "$__cube_line" = "$__cube_end" ] && break
    __cube_code+="$__cube_line"$'\n'
  done
  eval "$__cube_code" >"$__cube_dir/out" 2>"$__cube_dir/err"
  printf '%s\n' "$?" >&4
done
"#;

/// Errors of interpreter contexts.
#[derive(Debug, thiserror::Error)]
pub enum RunCodeError {
    /// The name is empty or already taken.
    #[error("a context named {0:?} already exists")]
    Exists(String),
    /// The name is unusable.
    #[error("invalid context name {0:?}")]
    BadName(String),
    /// No context has this name.
    #[error("no context named {0:?}")]
    NoSuchContext(String),
    /// Too many contexts are alive.
    #[error("too many contexts (at most {MAX_CONTEXTS})")]
    TooMany,
    /// The context's directory could not be made.
    #[error("creating the context directory {0}")]
    Dir(String, #[source] std::io::Error),
    /// The interpreter could not be started.
    #[error("starting the interpreter failed")]
    Spawn(#[source] ReaperError),
    /// Sending the cell to the interpreter failed.
    #[error("sending the cell to the interpreter failed")]
    Send(#[source] std::io::Error),
    /// The interpreter exited; the context is gone.
    #[error("the interpreter exited; the context was discarded")]
    Exited,
    /// The interpreter ignored the interrupt; it was killed and the context discarded.
    #[error("the interpreter did not stop after an interrupt; the context was discarded")]
    Stuck,
    /// The driver answered something unreadable.
    #[error("unreadable answer from the interpreter: {0}")]
    BadReply(String),
}

impl RunCodeError {
    /// The error reply for the host.
    pub fn to_reply(&self) -> ErrorReply {
        let message = crate::exec::error_chain(self);
        let code = match self {
            RunCodeError::Exists(_) => ErrorCode::AlreadyExists,
            RunCodeError::BadName(_) => ErrorCode::InvalidArgument,
            RunCodeError::NoSuchContext(_) => ErrorCode::NoSuchContext,
            RunCodeError::TooMany => ErrorCode::Busy,
            RunCodeError::Dir(_, e) => return ErrorReply::from_io(e, message),
            RunCodeError::Spawn(ReaperError::Spawn(e)) => return ErrorReply::from_io(e, message),
            RunCodeError::Spawn(_) | RunCodeError::Send(_) => ErrorCode::Io,
            RunCodeError::Exited | RunCodeError::Stuck | RunCodeError::BadReply(_) => {
                ErrorCode::ContextLost
            }
        };
        ErrorReply::new(code, message)
    }
}

/// The interpreter contexts of a sandbox, by name.
pub struct Contexts {
    reaper: Reaper,
    table: Mutex<HashMap<String, Arc<Mutex<Interpreter>>>>,
}

/// Numbers contexts (and their directories) across the whole process.
static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(0);

/// Makes a fresh directory only the agent's user can enter; a name left over from an
/// earlier run with the same pid (PID 1 always is) is skipped, never reused.
fn private_dir() -> Result<PathBuf, RunCodeError> {
    let mut last_err = None;
    for _ in 0..64 {
        let n = NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("cube-ctx-{}-{n}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last_err = Some(e),
            Err(e) => return Err(RunCodeError::Dir(dir.display().to_string(), e)),
        }
    }
    let e = last_err.unwrap_or_else(|| std::io::Error::from_raw_os_error(libc::EEXIST));
    Err(RunCodeError::Dir(
        std::env::temp_dir().display().to_string(),
        e,
    ))
}

/// One running interpreter.
struct Interpreter {
    language: Language,
    pid: Pid,
    status: ChildStatus,
    stdin: ChildStdin,
    lines: Receiver<String>,
    dir: PathBuf,
    end_marker: String,
}

#[derive(Deserialize)]
struct PythonReply {
    stdout: String,
    stderr: String,
    value: Option<String>,
    rich: Vec<(String, String)>,
    error: Option<PythonError>,
}

#[derive(Deserialize)]
struct PythonError {
    name: String,
    value: String,
    traceback: String,
}

impl Contexts {
    /// No contexts yet; interpreters are spawned through `reaper`.
    pub fn new(reaper: Reaper) -> Self {
        Self {
            reaper,
            table: Mutex::default(),
        }
    }

    fn table(&self) -> MutexGuard<'_, HashMap<String, Arc<Mutex<Interpreter>>>> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts a context named `name`, its interpreter from `defaults` (with a user,
    /// the agent must be root; the interpreter's private directory is given to it).
    pub fn create(
        &self,
        name: &str,
        language: Language,
        cwd: Option<&str>,
        defaults: ProcessDefaults<'_>,
    ) -> Result<(), RunCodeError> {
        if name.is_empty() || name.len() > 256 || name.contains('\0') {
            return Err(RunCodeError::BadName(name.into()));
        }
        {
            let table = self.table();
            if table.contains_key(name) {
                return Err(RunCodeError::Exists(name.into()));
            }
            if table.len() >= MAX_CONTEXTS {
                return Err(RunCodeError::TooMany);
            }
        }
        let n = NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed);
        let interp = Interpreter::start(&self.reaper, language, cwd, defaults, n)?;
        let mut table = self.table();
        if table.contains_key(name) {
            // Lost a race with a create of the same name; `interp` is dropped (killed).
            return Err(RunCodeError::Exists(name.into()));
        }
        table.insert(name.into(), Arc::new(Mutex::new(interp)));
        Ok(())
    }

    /// Runs one cell in context `name`; cells of one context run one at a time.
    pub fn run(
        &self,
        name: &str,
        code: &str,
        timeout: Option<Duration>,
    ) -> Result<CodeResult, RunCodeError> {
        let interp = self
            .table()
            .get(name)
            .cloned()
            .ok_or_else(|| RunCodeError::NoSuchContext(name.into()))?;
        let result = interp
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .run(code, timeout);
        if matches!(
            result,
            Err(RunCodeError::Exited | RunCodeError::Stuck | RunCodeError::BadReply(_))
        ) {
            let mut table = self.table();
            if table.get(name).is_some_and(|i| Arc::ptr_eq(i, &interp)) {
                table.remove(name);
            }
        }
        result
    }

    /// Stops context `name`.
    pub fn delete(&self, name: &str) -> Result<(), RunCodeError> {
        self.table()
            .remove(name)
            .map(drop)
            .ok_or_else(|| RunCodeError::NoSuchContext(name.into()))
    }

    /// The contexts alive, sorted by name.
    pub fn list(&self) -> Vec<ContextInfo> {
        let mut v: Vec<ContextInfo> = self
            .table()
            .iter()
            .map(|(name, i)| ContextInfo {
                name: name.clone(),
                language: i.lock().unwrap_or_else(PoisonError::into_inner).language,
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Stops every context (shutdown).
    pub fn clear(&self) {
        let all: Vec<_> = self.table().drain().collect();
        drop(all);
    }
}

impl Interpreter {
    fn start(
        reaper: &Reaper,
        language: Language,
        cwd: Option<&str>,
        defaults: ProcessDefaults<'_>,
        n: u64,
    ) -> Result<Self, RunCodeError> {
        let (env, user) = (defaults.env, defaults.user);
        let dir = private_dir()?;
        if let Some(user) = user {
            // The interpreter writes its cells' files there.
            if let Err(e) = std::os::unix::fs::chown(&dir, Some(user.uid), Some(user.gid)) {
                let _ = std::fs::remove_dir(&dir);
                return Err(RunCodeError::Dir(dir.display().to_string(), e));
            }
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let end_marker = format!("__CUBE_END_{nanos:x}_{n:x}__");
        let mut cmd = match language {
            Language::Python => {
                let mut c = Command::new("python3");
                c.args(["-u", "-c", PYTHON_DRIVER]);
                c
            }
            Language::Bash => {
                let mut c = Command::new("bash");
                c.args(["--noprofile", "--norc", "-c", BASH_DRIVER]);
                c
            }
        };
        cmd.env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("CUBE_CTX_DIR", &dir)
            .env("CUBE_END", &end_marker)
            .env("CUBE_OUTPUT_LIMIT", OUTPUT_LIMIT.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0);
        if !env.iter().any(|(k, _)| k == "PATH") {
            cmd.env("PATH", crate::exec::DEFAULT_PATH);
        }
        if let Some(cwd) = cwd {
            cmd.current_dir(cwd);
        }
        if let Some(user) = user {
            // std also empties the supplementary groups, the agent being root.
            cmd.uid(user.uid).gid(user.gid);
        }
        // SAFETY: the hook runs between fork and exec and makes only async-signal-safe
        // calls (see `reset_signals`).
        unsafe {
            cmd.pre_exec(crate::exec::reset_signals);
        }
        let (mut child, status) = match reaper.spawn(&mut cmd) {
            Ok(x) => x,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(RunCodeError::Spawn(e));
            }
        };
        let pid = Pid::from_raw(child.id() as i32);
        let (stdin, stdout) = match (child.stdin.take(), child.stdout.take()) {
            (Some(i), Some(o)) => (i, o),
            _ => {
                let _ = killpg(pid, Signal::SIGKILL);
                let _ = std::fs::remove_dir_all(&dir);
                return Err(RunCodeError::Exited);
            }
        };
        let (tx, lines) = mpsc::channel();
        let reader = std::thread::Builder::new()
            .name(format!("context-{n}"))
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        let interp = Self {
            language,
            pid,
            status,
            stdin,
            lines,
            dir,
            end_marker,
        };
        // On failure `interp` is dropped, which kills the interpreter.
        reader.map_err(|e| RunCodeError::Spawn(ReaperError::Thread(e)))?;
        Ok(interp)
    }

    fn run(&mut self, code: &str, timeout: Option<Duration>) -> Result<CodeResult, RunCodeError> {
        let request = match self.language {
            Language::Python => {
                let mut line = serde_json::json!({ "code": code }).to_string();
                line.push('\n');
                line
            }
            Language::Bash => {
                let mut cell = code.to_string();
                if !cell.ends_with('\n') {
                    cell.push('\n');
                }
                cell.push_str(&self.end_marker);
                cell.push('\n');
                cell
            }
        };
        self.stdin
            .write_all(request.as_bytes())
            .and_then(|_| self.stdin.flush())
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::BrokenPipe => RunCodeError::Exited,
                _ => RunCodeError::Send(e),
            })?;
        let mut timed_out = false;
        let line = match self.lines.recv_timeout(timeout.unwrap_or(NO_TIMEOUT)) {
            Ok(line) => line,
            Err(RecvTimeoutError::Disconnected) => return Err(RunCodeError::Exited),
            Err(RecvTimeoutError::Timeout) => {
                timed_out = true;
                let _ = match self.language {
                    Language::Python => kill(self.pid, Signal::SIGINT),
                    // The cell's commands run in the shell's process group.
                    Language::Bash => killpg(self.pid, Signal::SIGINT),
                };
                match self.lines.recv_timeout(INTERRUPT_GRACE) {
                    Ok(line) => line,
                    Err(RecvTimeoutError::Disconnected) => return Err(RunCodeError::Exited),
                    Err(RecvTimeoutError::Timeout) => return Err(RunCodeError::Stuck),
                }
            }
        };
        let mut result = match self.language {
            Language::Python => python_result(&line)?,
            Language::Bash => self.bash_result(&line)?,
        };
        result.timed_out = timed_out;
        Ok(result)
    }

    fn bash_result(&self, line: &str) -> Result<CodeResult, RunCodeError> {
        let status: i32 = line
            .trim()
            .parse()
            .map_err(|_| RunCodeError::BadReply(line.chars().take(200).collect()))?;
        Ok(CodeResult {
            stdout: read_limited(&self.dir.join("out")),
            stderr: read_limited(&self.dir.join("err")),
            exit_status: Some(status),
            ..CodeResult::default()
        })
    }
}

impl Drop for Interpreter {
    fn drop(&mut self) {
        let _ = killpg(self.pid, Signal::SIGKILL);
        let _ = self.status.wait_timeout(Duration::from_secs(5));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn python_result(line: &str) -> Result<CodeResult, RunCodeError> {
    let bad = |_| RunCodeError::BadReply(line.chars().take(200).collect());
    let reply: PythonReply = serde_json::from_str(line).map_err(bad)?;
    let rich = reply
        .rich
        .into_iter()
        .map(|(mime, hex)| {
            decode_hex(&hex)
                .map(|data| RichOutput { mime, data })
                .ok_or_else(|| RunCodeError::BadReply("bad hex in rich output".into()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(CodeResult {
        stdout: reply.stdout,
        stderr: reply.stderr,
        value: reply.value,
        rich,
        error: reply.error.map(|e| CodeError {
            name: e.name,
            value: e.value,
            traceback: e.traceback,
        }),
        exit_status: None,
        timed_out: false,
    })
}

/// A file's text, cut at [`OUTPUT_LIMIT`] bytes; empty when it cannot be read.
fn read_limited(path: &Path) -> String {
    let mut buf = Vec::new();
    if let Ok(f) = std::fs::File::open(path) {
        let _ = f.take(OUTPUT_LIMIT as u64 + 1).read_to_end(&mut buf);
    }
    let cut = buf.len() > OUTPUT_LIMIT;
    buf.truncate(OUTPUT_LIMIT);
    let mut s = String::from_utf8_lossy(&buf).into_owned();
    if cut {
        s.push_str("\n[output truncated]\n");
    }
    s
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if hex.len() & 1 != 0 {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Starts a context with the test's own PATH, HOME and pyenv variables.
    fn create(
        ctxs: &Contexts,
        name: &str,
        language: Language,
        cwd: Option<&str>,
    ) -> Result<(), RunCodeError> {
        let env: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k == "PATH" || k == "HOME" || k.starts_with("PYENV"))
            .collect();
        let defaults = ProcessDefaults {
            env: &env,
            user: None,
        };
        ctxs.create(name, language, cwd, defaults)
    }

    fn have(program: &str) -> bool {
        Command::new(program)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    #[test]
    fn python_keeps_state_and_reports_values_and_errors() {
        if !have("python3") {
            println!("skipped: python3 is not installed");
            return;
        }
        let ctxs = Contexts::new(Reaper::per_child());
        create(&ctxs, "py", Language::Python, None).unwrap();
        let r = ctxs.run("py", "x = 20\nprint('hi')\nx + 1", None).unwrap();
        assert_eq!(r.stdout, "hi\n");
        assert_eq!(r.value.as_deref(), Some("21"));
        assert!(r.error.is_none());

        let r = ctxs
            .run(
                "py",
                "import os, sys\nos.system('echo from-fd')\nprint('e', file=sys.stderr)\nx * 2",
                None,
            )
            .unwrap();
        assert_eq!(r.value.as_deref(), Some("40"));
        assert!(r.stdout.contains("from-fd"), "{r:?}");
        assert_eq!(r.stderr, "e\n");

        let r = ctxs
            .run("py", "def f():\n    return 1 / 0\nf()", None)
            .unwrap();
        let e = r.error.unwrap();
        assert_eq!(e.name, "ZeroDivisionError");
        assert_eq!(e.value, "division by zero");
        assert!(e.traceback.contains("in f"), "{}", e.traceback);
        assert!(!e.traceback.contains("<string>"), "{}", e.traceback);

        let r = ctxs.run("py", "x = (", None).unwrap();
        assert_eq!(r.error.unwrap().name, "SyntaxError");

        // A rich form from the value's _repr_png_.
        let r = ctxs
            .run(
                "py",
                "class P:\n    def _repr_png_(self):\n        return b'\\x89PNG'\nP()",
                None,
            )
            .unwrap();
        assert_eq!(
            r.rich,
            vec![RichOutput {
                mime: "image/png".into(),
                data: b"\x89PNG".to_vec()
            }]
        );

        // A statement has no value; SystemExit does not end the context.
        let r = ctxs.run("py", "y = x", None).unwrap();
        assert_eq!(r.value, None);
        let r = ctxs.run("py", "raise SystemExit(3)", None).unwrap();
        assert_eq!(r.error.unwrap().name, "SystemExit");
        assert_eq!(
            ctxs.run("py", "y", None).unwrap().value.as_deref(),
            Some("20")
        );
    }

    #[test]
    fn python_timeout_interrupts_the_cell_but_keeps_the_context() {
        if !have("python3") {
            println!("skipped: python3 is not installed");
            return;
        }
        let ctxs = Contexts::new(Reaper::per_child());
        create(&ctxs, "t", Language::Python, None).unwrap();
        ctxs.run("t", "kept = 'yes'", None).unwrap();
        let r = ctxs
            .run(
                "t",
                "import time\nwhile True:\n    time.sleep(0.01)",
                Some(Duration::from_millis(300)),
            )
            .unwrap();
        assert!(r.timed_out);
        assert_eq!(r.error.unwrap().name, "KeyboardInterrupt");
        let r = ctxs.run("t", "kept", None).unwrap();
        assert_eq!(r.value.as_deref(), Some("'yes'"));
        assert!(!r.timed_out);
    }

    #[test]
    fn bash_keeps_state_and_reports_status() {
        if !have("bash") {
            println!("skipped: bash is not installed");
            return;
        }
        let ctxs = Contexts::new(Reaper::per_child());
        let dir = tempfile::tempdir().unwrap();
        create(
            &ctxs,
            "sh",
            Language::Bash,
            Some(&dir.path().display().to_string()),
        )
        .unwrap();
        let r = ctxs
            .run(
                "sh",
                "A=5\ncd sub 2>/dev/null || mkdir sub && cd sub\necho made",
                None,
            )
            .unwrap();
        assert_eq!(r.stdout, "made\n");
        assert_eq!(r.exit_status, Some(0));
        let r = ctxs
            .run("sh", "echo $A; basename $PWD; echo oops >&2; false", None)
            .unwrap();
        assert_eq!(r.stdout, "5\nsub\n");
        assert_eq!(r.stderr, "oops\n");
        assert_eq!(r.exit_status, Some(1));
        let r = ctxs
            .run("sh", "sleep 30", Some(Duration::from_millis(200)))
            .unwrap();
        assert!(r.timed_out);
        assert_eq!(ctxs.run("sh", "echo $A", None).unwrap().stdout, "5\n");
    }

    #[test]
    fn contexts_are_named_listed_and_deleted() {
        if !have("bash") {
            println!("skipped: bash is not installed");
            return;
        }
        let ctxs = Contexts::new(Reaper::per_child());
        create(&ctxs, "b", Language::Bash, None).unwrap();
        create(&ctxs, "a", Language::Bash, None).unwrap();
        assert!(matches!(
            create(&ctxs, "a", Language::Bash, None),
            Err(RunCodeError::Exists(_))
        ));
        ctxs.run("a", "V=in-a", None).unwrap();
        assert_eq!(
            ctxs.run("b", "echo ${V:-unset}", None).unwrap().stdout,
            "unset\n"
        );
        let names: Vec<String> = ctxs.list().into_iter().map(|c| c.name).collect();
        assert_eq!(names, ["a", "b"]);
        ctxs.delete("a").unwrap();
        assert!(matches!(
            ctxs.run("a", "true", None),
            Err(RunCodeError::NoSuchContext(_))
        ));
        // A cell that ends the interpreter loses the context, with a clear error.
        let err = ctxs.run("b", "exit 0", None).unwrap_err();
        assert_eq!(err.to_reply().code, ErrorCode::ContextLost);
        assert!(ctxs.list().is_empty());
    }

    #[test]
    fn hex_decoding() {
        assert_eq!(decode_hex("00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(decode_hex("0"), None);
        assert_eq!(decode_hex("zz"), None);
    }
}
