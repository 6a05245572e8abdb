//! `cube serve` with real jail sandboxes: the sandbox plane's auth (one sandbox's token
//! never opens another), E2B-shaped errors for malformed bodies, unknown ids, oversized
//! uploads and bad Connect frames (the server stays up), interactive stdin, the port
//! proxy, and a restarted server that reattaches and keeps end times.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cube_server::config::{CliOverrides, ServeConfig};
use serde_json::{json, Value};

const KEY: &str = "integration-test-key-0123456789";

/// Why this host cannot run the tests, if it cannot.
fn skip() -> bool {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: jail sandboxes need root (namespaces, mounts, cgroups)");
        return true;
    }
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    for bin in ["cube-supervisor", "cube-agent"] {
        assert!(
            dir.join(bin).is_file(),
            "{} is missing: build it first (cargo build -p cube-core -p cube-agent --bins)",
            dir.join(bin).display()
        );
    }
    false
}

/// A server on a private store, stopped on drop (its sandboxes keep running until
/// [`Server::destroy_all`]).
struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(store: &Path, max_upload: Option<u64>) -> Server {
        let mut file = cube_server::config::FileConfig {
            pool_size: Some(0),
            ..Default::default()
        };
        file.max_upload_bytes = max_upload;
        let config = ServeConfig::resolve(
            file,
            CliOverrides {
                listen: Some("127.0.0.1:0".parse().unwrap()),
                api_keys: vec![KEY.into()],
                store: Some(store.to_path_buf()),
                ..CliOverrides::default()
            },
        )
        .unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                cube_server::serve_with(
                    config,
                    async {
                        let _ = stop_rx.await;
                    },
                    move |b| {
                        let _ = addr_tx.send(b.main);
                    },
                )
                .await
                .unwrap();
            });
        });
        let addr = addr_rx.recv_timeout(Duration::from_secs(60)).unwrap();
        Server {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    /// One HTTP/1.1 request; returns status, headers (lower-case names) and body.
    fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> (u16, Vec<(String, String)>, Vec<u8>) {
        let a = cube_server::http_client::request(self.addr, method, path, headers, body).unwrap();
        (a.status, a.headers, a.body)
    }

    fn api(&self, method: &str, path: &str, body: Value) -> (u16, Value) {
        let data = if body.is_null() {
            Vec::new()
        } else {
            body.to_string().into_bytes()
        };
        let (status, _, out) = self.request(
            method,
            path,
            &[("X-API-KEY", KEY), ("Content-Type", "application/json")],
            &data,
        );
        let v = if out.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&out).unwrap_or_else(|_| json!(String::from_utf8_lossy(&out)))
        };
        (status, v)
    }

    fn create(&self, extra: Value) -> Value {
        let mut body = json!({ "templateID": "base", "timeout": 300 });
        if let Value::Object(m) = extra {
            for (k, v) in m {
                body[k] = v;
            }
        }
        let (status, v) = self.api("POST", "/v2/sandboxes", body);
        assert_eq!(status, 201, "{v}");
        v
    }

    /// A unary Connect call in JSON to `sb`'s envd.
    fn rpc(&self, sb: &Value, method: &str, msg: Value) -> (u16, Value) {
        let (status, _, out) = self.request(
            "POST",
            method,
            &[
                ("E2b-Sandbox-Id", sb["sandboxID"].as_str().unwrap()),
                ("E2b-Sandbox-Port", "49983"),
                ("X-Access-Token", sb["envdAccessToken"].as_str().unwrap()),
                ("Content-Type", "application/json"),
            ],
            msg.to_string().as_bytes(),
        );
        (status, serde_json::from_slice(&out).unwrap_or(Value::Null))
    }

    fn destroy_all(&self) {
        let (_, list) = self.api("GET", "/v2/sandboxes", Value::Null);
        for s in list.as_array().cloned().unwrap_or_default() {
            let id = s["sandboxID"].as_str().unwrap().to_string();
            self.api("DELETE", &format!("/sandboxes/{id}"), Value::Null);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The messages of a Connect server stream in JSON (envelopes), the end one last.
fn envelopes(mut body: &[u8]) -> Vec<Value> {
    let mut out = Vec::new();
    while body.len() >= 5 {
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        out.push(serde_json::from_slice(&body[5..5 + len]).unwrap());
        body = &body[5 + len..];
    }
    out
}

fn envelope(msg: &Value) -> Vec<u8> {
    let data = msg.to_string().into_bytes();
    let mut v = vec![0u8];
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(&data);
    v
}

/// Starts a command in sandbox `sb` through `Start` on a connection of its own; the
/// thread ends with the call's status and every message of its stream.
fn start_in_background(
    server: &Server,
    sb: &Value,
    start: Value,
) -> std::thread::JoinHandle<(u16, Vec<Value>)> {
    let addr = server.addr;
    let (id, token) = (
        sb["sandboxID"].as_str().unwrap().to_string(),
        sb["envdAccessToken"].as_str().unwrap().to_string(),
    );
    std::thread::spawn(move || {
        let s = Server {
            addr,
            stop: None,
            thread: None,
        };
        let (status, _, body) = s.request(
            "POST",
            "/process.Process/Start",
            &[
                ("E2b-Sandbox-Id", &id),
                ("X-Access-Token", &token),
                ("Content-Type", "application/connect+json"),
            ],
            &envelope(&start),
        );
        (status, envelopes(&body))
    })
}

fn store() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::TempDir::new().unwrap();
    let root = dir.path().canonicalize().unwrap();
    (dir, root)
}

#[test]
fn tokens_errors_and_a_server_that_stays_up() {
    if skip() {
        return;
    }
    let (_dir, root) = store();
    let server = Server::start(&root, Some(1 << 20));
    let a = server.create(json!({}));
    let b = server.create(json!({}));
    let (a_id, b_id) = (
        a["sandboxID"].as_str().unwrap(),
        b["sandboxID"].as_str().unwrap(),
    );
    assert!(!a_id.contains('-'), "E2B ids have no hyphens: {a_id}");

    // No key, a wrong key: 401 in E2B's shape.
    let (status, _, body) = server.request("GET", "/v2/sandboxes", &[], b"");
    assert_eq!(status, 401);
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["code"], 401);
    let (status, _, _) = server.request(
        "GET",
        "/v2/sandboxes",
        &[("X-API-KEY", "wrong-key-wrong-key")],
        b"",
    );
    assert_eq!(status, 401);

    // A's token does not open B, with B's id in the header or by host name.
    let files = "/files?path=%2Fetc%2Fhostname";
    let (status, _, _) = server.request(
        "GET",
        files,
        &[
            ("E2b-Sandbox-Id", b_id),
            ("X-Access-Token", a["envdAccessToken"].as_str().unwrap()),
        ],
        b"",
    );
    assert_eq!(status, 401);
    let host = format!("49983-{b_id}.cube.local");
    let (status, _, _) = server.request(
        "GET",
        files,
        &[
            ("Host", &host),
            ("X-Access-Token", a["envdAccessToken"].as_str().unwrap()),
        ],
        b"",
    );
    assert_eq!(status, 401);
    let (status, _, _) = server.request(
        "GET",
        files,
        &[
            ("E2b-Sandbox-Id", b_id),
            ("X-Access-Token", b["envdAccessToken"].as_str().unwrap()),
        ],
        b"",
    );
    assert_eq!(status, 200);
    // A traffic token opens its own sandbox's ports too, and only those.
    let (status, _, _) = server.request(
        "GET",
        "/contexts",
        &[
            ("E2b-Sandbox-Id", b_id),
            ("E2b-Sandbox-Port", "49999"),
            (
                "E2B-Traffic-Access-Token",
                a["trafficAccessToken"].as_str().unwrap(),
            ),
        ],
        b"",
    );
    assert_eq!(status, 401);

    // Malformed bodies, unknown ids.
    let (status, v) = server.api("POST", "/v2/sandboxes", json!({ "timeout": "soon" }));
    assert_eq!((status, v["code"].as_u64()), (400, Some(400)), "{v}");
    let (status, _, _) =
        server.request("POST", "/v2/sandboxes", &[("X-API-KEY", KEY)], b"{not json");
    assert_eq!(status, 400);
    let (status, v) = server.api("GET", "/sandboxes/0123456789abcdef", Value::Null);
    assert_eq!((status, v["code"].as_u64()), (404, Some(404)));
    let (status, _) = server.api("GET", "/sandboxes/../../etc", Value::Null);
    assert_eq!(status, 404);
    let (status, v) = server.api(
        "POST",
        "/v2/sandboxes",
        json!({ "templateID": "no-such-template" }),
    );
    assert_eq!(status, 404, "{v}");
    let (status, _, _) = server.request(
        "GET",
        files,
        &[
            ("E2b-Sandbox-Id", "0123456789abcdef"),
            ("X-Access-Token", "x"),
        ],
        b"",
    );
    assert_eq!(status, 502, "an unknown sandbox is reported as not running");

    // An upload over the limit: 413, E2B-shaped.
    let big = vec![7u8; (1 << 20) + 200_000];
    let (status, _, body) = server.request(
        "POST",
        "/files?path=%2Fhome%2Fuser%2Fbig",
        &[
            ("E2b-Sandbox-Id", a_id),
            ("X-Access-Token", a["envdAccessToken"].as_str().unwrap()),
            ("Content-Type", "application/octet-stream"),
        ],
        &big,
    );
    assert_eq!(status, 413);
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["code"], 413);

    // Bad Connect frames: a truncated envelope, garbage JSON, an unknown method.
    let token = a["envdAccessToken"].as_str().unwrap();
    let rpc_headers = [
        ("E2b-Sandbox-Id", a_id),
        ("X-Access-Token", token),
        ("Content-Type", "application/connect+json"),
    ];
    let (status, _, body) = server.request(
        "POST",
        "/process.Process/Start",
        &rpc_headers,
        &[0, 0, 0, 0, 50, b'{'],
    );
    assert_eq!(status, 200);
    let end = envelopes(&body);
    assert_eq!(end.last().unwrap()["error"]["code"], "invalid_argument");
    let (status, v) = server.rpc(&a, "/filesystem.Filesystem/Stat", json!("not an object"));
    assert_eq!(
        (status, v["code"].as_str()),
        (400, Some("invalid_argument"))
    );
    let (status, v) = server.rpc(&a, "/filesystem.Filesystem/Nope", json!({}));
    assert_eq!((status, v["code"].as_str()), (501, Some("unimplemented")));
    let (status, v) = server.rpc(
        &a,
        "/filesystem.Filesystem/Stat",
        json!({ "path": "/no/such" }),
    );
    assert_eq!((status, v["code"].as_str()), (404, Some("not_found")));

    // Still serving.
    let (status, v) = server.rpc(
        &a,
        "/filesystem.Filesystem/Stat",
        json!({ "path": "/home/user" }),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["entry"]["type"], "FILE_TYPE_DIRECTORY");
    server.destroy_all();
}

#[test]
fn stdin_signals_and_the_port_proxy() {
    if skip() {
        return;
    }
    let (_dir, root) = store();
    let server = Server::start(&root, None);
    let sb = server.create(json!({}));
    let (id, token) = (
        sb["sandboxID"].as_str().unwrap(),
        sb["envdAccessToken"].as_str().unwrap(),
    );
    // Interactive stdin: `cat` started with stdin open, fed and closed over SendInput
    // and CloseStdin while its Start stream is read on another connection.
    let reader = start_in_background(
        &server,
        &sb,
        json!({
            "process": { "cmd": "/bin/cat", "args": [] },
            "stdin": true,
        }),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let pid = loop {
        let (_, list) = server.rpc(&sb, "/process.Process/List", json!({}));
        if let Some(p) = list["processes"].as_array().and_then(|a| a.first()) {
            break p["pid"].as_u64().unwrap();
        }
        assert!(Instant::now() < deadline, "cat never showed up in List");
        std::thread::sleep(Duration::from_millis(50));
    };
    use base64::Engine as _;
    let data = base64::engine::general_purpose::STANDARD.encode(b"through stdin\n");
    let (status, v) = server.rpc(
        &sb,
        "/process.Process/SendInput",
        json!({ "process": { "pid": pid }, "input": { "stdin": data } }),
    );
    assert_eq!(status, 200, "{v}");
    let (status, v) = server.rpc(
        &sb,
        "/process.Process/CloseStdin",
        json!({ "process": { "pid": pid } }),
    );
    assert_eq!(status, 200, "{v}");
    let (status, events) = reader.join().unwrap();
    assert_eq!(status, 200);
    let out: Vec<u8> = events
        .iter()
        .filter_map(|e| e["event"]["data"]["stdout"].as_str())
        .flat_map(|s| base64::engine::general_purpose::STANDARD.decode(s).unwrap())
        .collect();
    assert_eq!(out, b"through stdin\n");
    let end = events
        .iter()
        .find(|e| e["event"]["end"].is_object())
        .unwrap();
    assert_eq!(end["event"]["end"]["exitCode"], 0);
    // Once a command's end has been read, List no longer shows it: the E2B SDK lists
    // right after a wait (CI once saw a killed command still listed).
    for round in 0..20 {
        let (status, _, body) = server.request(
            "POST",
            "/process.Process/Start",
            &[
                ("E2b-Sandbox-Id", id),
                ("X-Access-Token", token),
                ("Content-Type", "application/connect+json"),
            ],
            &envelope(&json!({ "process": { "cmd": "/bin/true", "args": [] }, "stdin": false })),
        );
        assert_eq!(status, 200);
        let events = envelopes(&body);
        assert!(
            events.iter().any(|e| e["event"]["end"].is_object()),
            "round {round}: no end event in {events:?}"
        );
        let (_, list) = server.rpc(&sb, "/process.Process/List", json!({}));
        assert_eq!(
            list["processes"].as_array().map_or(0, Vec::len),
            0,
            "round {round}: an ended command is still listed: {list}"
        );
    }
    // A signal for a process that is gone: not_found.
    let (status, v) = server.rpc(
        &sb,
        "/process.Process/SendSignal",
        json!({ "process": { "pid": pid }, "signal": "SIGNAL_SIGKILL" }),
    );
    assert_eq!((status, v["code"].as_str()), (404, Some("not_found")));

    // A web server in the sandbox, reached through the proxy by port header and host.
    let server_cmd = envelope(&json!({
        "process": { "cmd": "/bin/bash", "args": ["-c", "mkdir -p /home/user/www && echo proxied > /home/user/www/index.html && cd /home/user/www && exec python3 -m http.server 8000 --bind 127.0.0.1"] },
        "stdin": false,
    }));
    let addr = server.addr;
    let (id3, token3) = (id.to_string(), token.to_string());
    std::thread::spawn(move || {
        let s = Server {
            addr,
            stop: None,
            thread: None,
        };
        s.request(
            "POST",
            "/process.Process/Start",
            &[
                ("E2b-Sandbox-Id", &id3),
                ("X-Access-Token", &token3),
                ("Content-Type", "application/connect+json"),
            ],
            &server_cmd,
        )
    });
    let traffic = sb["trafficAccessToken"].as_str().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, _, body) = server.request(
            "GET",
            "/index.html",
            &[
                ("E2b-Sandbox-Id", id),
                ("E2b-Sandbox-Port", "8000"),
                ("E2B-Traffic-Access-Token", traffic),
            ],
            b"",
        );
        if status == 200 {
            assert_eq!(body, b"proxied\n");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the web server never answered: {status}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let host = format!("8000-{id}.cube.local");
    let (status, _, body) = server.request(
        "GET",
        "/index.html",
        &[("Host", &host), ("E2B-Traffic-Access-Token", traffic)],
        b"",
    );
    assert_eq!((status, body.as_slice()), (200, b"proxied\n".as_slice()));
    // Nothing listens on 8001: a 502, and the server goes on.
    let (status, _, _) = server.request(
        "GET",
        "/",
        &[
            ("E2b-Sandbox-Id", id),
            ("E2b-Sandbox-Port", "8001"),
            ("E2B-Traffic-Access-Token", traffic),
        ],
        b"",
    );
    assert_eq!(status, 502);
    server.destroy_all();
}

#[test]
fn a_pty_command_is_typed_into_and_resized() {
    if skip() {
        return;
    }
    let (_dir, root) = store();
    let server = Server::start(&root, None);
    let sb = server.create(json!({}));
    // A shell on a 33 x 77 terminal: it prints its size, says it is ready, reads a
    // typed line, prints its size again (after the resize) and what it read.
    let reader = start_in_background(
        &server,
        &sb,
        json!({
            "process": { "cmd": "/bin/sh", "args": ["-c",
                "tty; stty size; touch /tmp/pty-ready; read l; stty size; echo got:$l; exit 3"] },
            "pty": { "size": { "rows": 33, "cols": 77 } },
        }),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let pid = loop {
        let (status, _) = server.rpc(
            &sb,
            "/filesystem.Filesystem/Stat",
            json!({ "path": "/tmp/pty-ready" }),
        );
        let (_, list) = server.rpc(&sb, "/process.Process/List", json!({}));
        if let (200, Some(p)) = (status, list["processes"].as_array().and_then(|a| a.first())) {
            break p["pid"].as_u64().unwrap();
        }
        assert!(Instant::now() < deadline, "the shell never got ready");
        std::thread::sleep(Duration::from_millis(50));
    };
    use base64::Engine as _;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    // Input for a terminal goes as pty input: stdin input is refused, saying why.
    let (status, v) = server.rpc(
        &sb,
        "/process.Process/SendInput",
        json!({ "process": { "pid": pid }, "input": { "stdin": b64(b"x\n") } }),
    );
    assert_eq!(status, 400, "{v}");
    assert!(v["message"].as_str().unwrap().contains("as pty"), "{v}");
    // A size of nothing is refused; a real one is taken.
    let (status, v) = server.rpc(
        &sb,
        "/process.Process/Update",
        json!({ "process": { "pid": pid }, "pty": { "size": { "rows": 0, "cols": 100 } } }),
    );
    assert_eq!(
        (status, v["code"].as_str()),
        (400, Some("invalid_argument")),
        "{v}"
    );
    let (status, v) = server.rpc(
        &sb,
        "/process.Process/Update",
        json!({ "process": { "pid": pid }, "pty": { "size": { "rows": 40, "cols": 100 } } }),
    );
    assert_eq!(status, 200, "{v}");
    let (status, v) = server.rpc(
        &sb,
        "/process.Process/SendInput",
        json!({ "process": { "pid": pid }, "input": { "pty": b64(b"hi\n") } }),
    );
    assert_eq!(status, 200, "{v}");
    let (status, events) = reader.join().unwrap();
    assert_eq!(status, 200);
    let shown: Vec<u8> = events
        .iter()
        .filter_map(|e| e["event"]["data"]["pty"].as_str())
        .flat_map(|s| base64::engine::general_purpose::STANDARD.decode(s).unwrap())
        .collect();
    let shown = String::from_utf8_lossy(&shown);
    assert!(
        events
            .iter()
            .all(|e| e["event"]["data"]["stdout"].is_null()),
        "a terminal's output came as stdout: {events:?}"
    );
    assert!(shown.contains("/dev/pts/"), "{shown:?}");
    let first = shown.find("33 77\r\n").expect("the size at start");
    let second = shown.find("40 100\r\n").expect("the size after Update");
    assert!(first < second, "{shown:?}");
    assert!(shown.contains("got:hi\r\n"), "{shown:?}");
    let end = events
        .iter()
        .find(|e| e["event"]["end"].is_object())
        .unwrap();
    assert_eq!(end["event"]["end"]["exitCode"], 3);
    // The shell has ended: resizing it is not_found.
    let (status, v) = server.rpc(
        &sb,
        "/process.Process/Update",
        json!({ "process": { "pid": pid }, "pty": { "size": { "rows": 40, "cols": 100 } } }),
    );
    assert_eq!(
        (status, v["code"].as_str()),
        (404, Some("not_found")),
        "{v}"
    );
    server.destroy_all();
}

#[test]
fn a_restarted_server_reattaches_and_keeps_end_times() {
    if skip() {
        return;
    }
    let (_dir, root) = store();
    let (keep_id, end_at, short_id) = {
        let server = Server::start(&root, None);
        let keep = server.create(json!({ "timeout": 600, "metadata": { "k": "v" } }));
        let short = server.create(json!({ "timeout": 600 }));
        let id = keep["sandboxID"].as_str().unwrap().to_string();
        let (_, info) = server.api("GET", &format!("/sandboxes/{id}"), Value::Null);
        let short_id = short["sandboxID"].as_str().unwrap().to_string();
        let (status, _) = server.api(
            "POST",
            &format!("/sandboxes/{short_id}/timeout"),
            json!({ "timeout": 3 }),
        );
        assert_eq!(status, 204);
        (id, info["endAt"].as_str().unwrap().to_string(), short_id)
        // The server stops here; the sandboxes go on.
    };
    std::thread::sleep(Duration::from_secs(4));
    let server = Server::start(&root, None);
    let (status, info) = server.api("GET", &format!("/sandboxes/{keep_id}"), Value::Null);
    assert_eq!(status, 200, "{info}");
    assert_eq!(info["endAt"].as_str().unwrap(), end_at);
    assert_eq!(info["metadata"]["k"], "v");
    // Its agent still answers through the new server.
    let keep = json!({ "sandboxID": keep_id, "envdAccessToken": info["envdAccessToken"] });
    let (status, _) = server.rpc(
        &keep,
        "/filesystem.Filesystem/Stat",
        json!({ "path": "/home/user" }),
    );
    assert_eq!(status, 200);
    // The one whose end passed while no server ran is killed at once.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, _) = server.api("GET", &format!("/sandboxes/{short_id}"), Value::Null);
        if status == 404 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the expired sandbox was not killed"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    server.destroy_all();
}
