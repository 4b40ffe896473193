//! The `flexinfer-standin` binary as the stand-in image runs it: the Model controller's vLLM command
//! line, a model directory, then `/health`, `/v1/models` and a completion over HTTP; a bad command
//! line exits 2 naming the flag.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_flexinfer-standin");

/// Kills the server when the test ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// One HTTP/1.1 exchange; the status code and the body.
fn http(port: u16, request: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
    s.write_all(request.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let code = out.split(' ').nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((code, body))
}

fn get(port: u16, path: &str) -> Option<(u16, String)> {
    http(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    )
}

#[test]
fn a_bad_command_line_exits_2_naming_the_flag() {
    let out = Command::new(BIN)
        .args([
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "/m",
            "--port",
            "x",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--port"), "{err}");
}

#[test]
fn serves_a_model_directory_over_http() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    flexinfer_quant::testkit::write_model(&model, "LlamaForCausalLM", 3).expect("model");
    let port = free_port();
    let _server = Server(
        Command::new(BIN)
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&model)
            .args([
                "--served-model-name",
                "demo",
                "--host",
                "127.0.0.1",
                "--port",
            ])
            .arg(port.to_string())
            .args(["--max-model-len", "256", "--enforce-eager"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start"),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some((200, _)) = get(port, "/health") {
            break;
        }
        assert!(Instant::now() < deadline, "no /health within 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (code, models) = get(port, "/v1/models").expect("models");
    assert_eq!(code, 200, "{models}");
    assert!(models.contains("\"demo\""), "{models}");
    let body = r#"{"model": "demo", "prompt": "the cat", "max_tokens": 3}"#;
    let (code, completion) = http(
        port,
        &format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
    .expect("completion");
    assert_eq!(code, 200, "{completion}");
    let v: serde_json::Value = serde_json::from_str(&completion).expect("json");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    assert!(v["choices"][0]["text"].is_string(), "{v}");
}
