//! The envd messages (`process.proto`, `filesystem.proto`), written out by hand from
//! envd's published schema: field numbers for the binary codec (prost), names for the
//! JSON codec (serde, camelCase out, both spellings in).

#![allow(missing_docs)] // The fields are the schema's; their meaning is envd's.

use serde::{Deserialize, Serialize};

use super::json::{bytes_b64, i32_lenient, i64_str, proto_enum_json, u32_lenient};

proto_enum_json!(
    signal_json,
    [
        (0, "SIGNAL_UNSPECIFIED"),
        (15, "SIGNAL_SIGTERM"),
        (9, "SIGNAL_SIGKILL")
    ]
);
proto_enum_json!(
    file_type_json,
    [
        (0, "FILE_TYPE_UNSPECIFIED"),
        (1, "FILE_TYPE_FILE"),
        (2, "FILE_TYPE_DIRECTORY"),
        (3, "FILE_TYPE_SYMLINK")
    ]
);
proto_enum_json!(
    event_type_json,
    [
        (0, "EVENT_TYPE_UNSPECIFIED"),
        (1, "EVENT_TYPE_CREATE"),
        (2, "EVENT_TYPE_WRITE"),
        (3, "EVENT_TYPE_REMOVE"),
        (4, "EVENT_TYPE_RENAME"),
        (5, "EVENT_TYPE_CHMOD")
    ]
);

/// `filesystem.FileType` values.
pub mod file_type {
    pub const FILE: i32 = 1;
    pub const DIRECTORY: i32 = 2;
    pub const SYMLINK: i32 = 3;
}

/// `filesystem.EventType` values.
pub mod event_type {
    pub const CREATE: i32 = 1;
    pub const WRITE: i32 = 2;
    pub const REMOVE: i32 = 3;
    pub const RENAME: i32 = 4;
    pub const CHMOD: i32 = 5;
}

/// An empty message (the many `...Response {}` and `KeepAlive {}`).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
pub struct Empty {}

// ---- process.proto ----

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PtySize {
    #[prost(uint32, tag = "1")]
    #[serde(with = "u32_lenient")]
    pub cols: u32,
    #[prost(uint32, tag = "2")]
    #[serde(with = "u32_lenient")]
    pub rows: u32,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Pty {
    #[prost(message, optional, tag = "1")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<PtySize>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ProcessConfig {
    #[prost(string, tag = "1")]
    pub cmd: String,
    #[prost(string, repeated, tag = "2")]
    pub args: Vec<String>,
    #[prost(map = "string, string", tag = "3")]
    pub envs: std::collections::HashMap<String, String>,
    #[prost(string, optional, tag = "4")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ProcessInfo {
    #[prost(message, optional, tag = "1")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<ProcessConfig>,
    #[prost(uint32, tag = "2")]
    #[serde(with = "u32_lenient")]
    pub pid: u32,
    #[prost(string, optional, tag = "3")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ListResponse {
    #[prost(message, repeated, tag = "1")]
    pub processes: Vec<ProcessInfo>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct StartRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessConfig>,
    #[prost(message, optional, tag = "2")]
    pub pty: Option<Pty>,
    #[prost(string, optional, tag = "3")]
    pub tag: Option<String>,
    #[prost(bool, optional, tag = "4")]
    pub stdin: Option<bool>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct UpdateRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessSelector>,
    #[prost(message, optional, tag = "2")]
    pub pty: Option<Pty>,
}

/// `process.ProcessSelector`: a process by pid or by tag.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ProcessSelector {
    #[prost(oneof = "Selector", tags = "1, 2")]
    #[serde(flatten)]
    pub selector: Option<Selector>,
}

#[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Selector {
    #[prost(uint32, tag = "1")]
    Pid(#[serde(with = "u32_lenient")] u32),
    #[prost(string, tag = "2")]
    Tag(String),
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct StartEvent {
    #[prost(uint32, tag = "1")]
    #[serde(with = "u32_lenient")]
    pub pid: u32,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct DataEvent {
    #[prost(oneof = "Output", tags = "1, 2, 3")]
    #[serde(flatten)]
    pub output: Option<Output>,
}

#[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Output {
    #[prost(bytes, tag = "1")]
    Stdout(#[serde(with = "bytes_b64")] Vec<u8>),
    #[prost(bytes, tag = "2")]
    Stderr(#[serde(with = "bytes_b64")] Vec<u8>),
    #[prost(bytes, tag = "3")]
    Pty(#[serde(with = "bytes_b64")] Vec<u8>),
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct EndEvent {
    #[prost(sint32, tag = "1")]
    #[serde(with = "i32_lenient", alias = "exit_code")]
    pub exit_code: i32,
    #[prost(bool, tag = "2")]
    pub exited: bool,
    #[prost(string, tag = "3")]
    pub status: String,
    #[prost(string, optional, tag = "4")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `process.ProcessEvent`.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ProcessEvent {
    #[prost(oneof = "Event", tags = "1, 2, 3, 4")]
    #[serde(flatten)]
    pub event: Option<Event>,
}

#[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Event {
    #[prost(message, tag = "1")]
    Start(StartEvent),
    #[prost(message, tag = "2")]
    Data(DataEvent),
    #[prost(message, tag = "3")]
    End(EndEvent),
    #[prost(message, tag = "4")]
    Keepalive(Empty),
}

/// `process.StartResponse` and `process.ConnectResponse` (the same shape).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct EventResponse {
    #[prost(message, optional, tag = "1")]
    pub event: Option<ProcessEvent>,
}

/// `process.ConnectRequest` and `process.CloseStdinRequest` (the same shape).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct SelectorRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessSelector>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ProcessInput {
    #[prost(oneof = "Input", tags = "1, 2")]
    #[serde(flatten)]
    pub input: Option<Input>,
}

#[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Input {
    #[prost(bytes, tag = "1")]
    Stdin(#[serde(with = "bytes_b64")] Vec<u8>),
    #[prost(bytes, tag = "2")]
    Pty(#[serde(with = "bytes_b64")] Vec<u8>),
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct SendInputRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessSelector>,
    #[prost(message, optional, tag = "2")]
    pub input: Option<ProcessInput>,
}

/// `process.StreamInputRequest`.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct StreamInputRequest {
    #[prost(oneof = "StreamInputEvent", tags = "1, 2, 3")]
    #[serde(flatten)]
    pub event: Option<StreamInputEvent>,
}

#[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StreamInputEvent {
    #[prost(message, tag = "1")]
    Start(SelectorRequest),
    #[prost(message, tag = "2")]
    Data(StreamInputData),
    #[prost(message, tag = "3")]
    Keepalive(Empty),
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct StreamInputData {
    #[prost(message, optional, tag = "2")]
    pub input: Option<ProcessInput>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct SendSignalRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessSelector>,
    #[prost(int32, tag = "2")]
    #[serde(with = "signal_json")]
    pub signal: i32,
}

// ---- filesystem.proto ----

/// `google.protobuf.Timestamp`; RFC 3339 in JSON.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Timestamp {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::json::rfc3339(
            self.seconds,
            u32::try_from(self.nanos).unwrap_or(0),
        ))
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let (seconds, nanos) = super::json::parse_rfc3339(&s)
            .ok_or_else(|| serde::de::Error::custom(format!("bad timestamp {s:?}")))?;
        Ok(Timestamp {
            seconds,
            nanos: nanos as i32,
        })
    }
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct EntryInfo {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(int32, tag = "2")]
    #[serde(rename = "type", with = "file_type_json")]
    pub kind: i32,
    #[prost(string, tag = "3")]
    pub path: String,
    #[prost(int64, tag = "4")]
    #[serde(with = "i64_str")]
    pub size: i64,
    #[prost(uint32, tag = "5")]
    #[serde(with = "u32_lenient")]
    pub mode: u32,
    #[prost(string, tag = "6")]
    pub permissions: String,
    #[prost(string, tag = "7")]
    pub owner: String,
    #[prost(string, tag = "8")]
    pub group: String,
    #[prost(message, optional, tag = "9")]
    #[serde(skip_serializing_if = "Option::is_none", alias = "modified_time")]
    pub modified_time: Option<Timestamp>,
    #[prost(string, optional, tag = "10")]
    #[serde(skip_serializing_if = "Option::is_none", alias = "symlink_target")]
    pub symlink_target: Option<String>,
    #[prost(map = "string, string", tag = "11")]
    #[serde(skip_serializing_if = "std::collections::HashMap::is_empty")]
    pub metadata: std::collections::HashMap<String, String>,
    #[prost(bool, tag = "12")]
    #[serde(alias = "is_symlink")]
    pub is_symlink: bool,
}

/// `filesystem.StatRequest`, `MakeDirRequest`, `RemoveRequest` (a path only).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PathRequest {
    #[prost(string, tag = "1")]
    pub path: String,
}

/// `StatResponse`, `MakeDirResponse`, `MoveResponse` (one entry).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct EntryResponse {
    #[prost(message, optional, tag = "1")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct MoveRequest {
    #[prost(string, tag = "1")]
    pub source: String,
    #[prost(string, tag = "2")]
    pub destination: String,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ListDirRequest {
    #[prost(string, tag = "1")]
    pub path: String,
    #[prost(uint32, tag = "2")]
    #[serde(with = "u32_lenient")]
    pub depth: u32,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ListDirResponse {
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<EntryInfo>,
}

/// `WatchDirRequest` and `CreateWatcherRequest` (the same fields).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct WatchRequest {
    #[prost(string, tag = "1")]
    pub path: String,
    #[prost(bool, tag = "2")]
    pub recursive: bool,
    #[prost(bool, tag = "3")]
    #[serde(alias = "include_entry")]
    pub include_entry: bool,
    #[prost(bool, tag = "4")]
    #[serde(alias = "allow_network_mounts")]
    pub allow_network_mounts: bool,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct FilesystemEvent {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(int32, tag = "2")]
    #[serde(rename = "type", with = "event_type_json")]
    pub kind: i32,
    #[prost(message, optional, tag = "3")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

/// `filesystem.WatchDirResponse`.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct WatchDirResponse {
    #[prost(oneof = "WatchEvent", tags = "1, 2, 3")]
    #[serde(flatten)]
    pub event: Option<WatchEvent>,
}

// A wire message, built once per event and sent on: boxing would only cost an
// allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum WatchEvent {
    #[prost(message, tag = "1")]
    Start(Empty),
    #[prost(message, tag = "2")]
    Filesystem(FilesystemEvent),
    #[prost(message, tag = "3")]
    Keepalive(Empty),
}

/// `CreateWatcherResponse`, `GetWatcherEventsRequest`, `RemoveWatcherRequest`.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct WatcherId {
    #[prost(string, tag = "1")]
    #[serde(alias = "watcher_id")]
    pub watcher_id: String,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct GetWatcherEventsResponse {
    #[prost(message, repeated, tag = "1")]
    pub events: Vec<FilesystemEvent>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn process_events_in_json_as_the_sdks_read_them() {
        let ev = EventResponse {
            event: Some(ProcessEvent {
                event: Some(Event::Data(DataEvent {
                    output: Some(Output::Stdout(b"hi\n".to_vec())),
                })),
            }),
        };
        let json = serde_json::to_string(&ev).unwrap();
        assert_eq!(json, r#"{"event":{"data":{"stdout":"aGkK"}}}"#);
        let end = ProcessEvent {
            event: Some(Event::End(EndEvent {
                exit_code: 3,
                exited: true,
                status: "exit status 3".into(),
                error: None,
            })),
        };
        assert_eq!(
            serde_json::to_string(&end).unwrap(),
            r#"{"end":{"exitCode":3,"exited":true,"status":"exit status 3"}}"#
        );
    }

    #[test]
    fn requests_read_from_json_in_either_spelling() {
        let r: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"}},"stdin":false}"#,
        )
        .unwrap();
        let p = r.process.unwrap();
        assert_eq!(p.args, ["-l", "-c", "echo hi"]);
        assert_eq!(r.stdin, Some(false));
        let s: SendSignalRequest =
            serde_json::from_str(r#"{"process":{"pid":"42"},"signal":"SIGNAL_SIGKILL"}"#).unwrap();
        assert_eq!(s.signal, 9);
        assert_eq!(s.process.unwrap().selector, Some(Selector::Pid(42)));
        let l: ListDirRequest = serde_json::from_str(r#"{"path":"/tmp","depth":2}"#).unwrap();
        assert_eq!(l.depth, 2);
        let w: WatchRequest =
            serde_json::from_str(r#"{"path":"/x","include_entry":true}"#).unwrap();
        assert!(w.include_entry);
        let empty: SelectorRequest = serde_json::from_str("{}").unwrap();
        assert!(empty.process.is_none());
    }

    #[test]
    fn binary_codec_round_trips() {
        let entry = EntryInfo {
            name: "a".into(),
            kind: file_type::FILE,
            path: "/a".into(),
            size: 5,
            modified_time: Some(Timestamp {
                seconds: 10,
                nanos: 0,
            }),
            ..Default::default()
        };
        let bytes = entry.encode_to_vec();
        assert_eq!(EntryInfo::decode(bytes.as_slice()).unwrap(), entry);
        let json = serde_json::to_value(&entry).unwrap();
        assert_eq!(json["size"], "5");
        assert_eq!(json["type"], "FILE_TYPE_FILE");
        assert_eq!(json["modifiedTime"], "1970-01-01T00:00:10Z");
    }
}
