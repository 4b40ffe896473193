//! A loopback HTTP server that answers one request with a JSON body: the hub as the tests see it.
//! Shared by the unit tests of `src/footprint.rs` and `tests/cluster.rs` (each includes this file with
//! `#[path]`); not a test target of its own (a file below `tests/support/`).
#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

use std::io::{Read, Write};

/// Serves `body` (as `application/json`, `200 OK`) to the first connection on a free loopback port.
/// Returns the endpoint (`http://127.0.0.1:PORT`) and the server thread, which joins to the text of
/// the request it read.
pub fn serve_json_once(body: &'static str) -> (String, std::thread::JoinHandle<String>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 4096];
        let n = s.read(&mut buf).unwrap();
        write!(
            s,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    });
    (format!("http://{addr}"), server)
}
