//! The one HTTP/1 accept loop of FlexInfer's processes: the controller's `/metrics` and probe
//! ports, the proxy's OpenAI front and health port, and the serving stand-in all run it.
//!
//! Each open connection holds a place; when none is free the loop stops accepting and new
//! connections wait in the kernel's listen backlog. A failed `accept` (out of file descriptors, a
//! connection reset before it was taken) is logged and retried after a short pause, never in a
//! tight loop. The loop ends when `shutdown` completes; connections already accepted finish on
//! their own tasks.

use std::error::Error as StdError;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::Service;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tracing::{debug, warn};

/// How long a failed `accept` waits before the next one.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// What one listener allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once (at least 1).
    pub max_connections: usize,
    /// A client that has not sent a whole request head within this time is dropped (slowloris);
    /// `None`: no limit.
    pub header_read_timeout: Option<Duration>,
    /// Set `TCP_NODELAY` on accepted sockets, so small streamed writes (token events) are not held
    /// back by Nagle's algorithm until the client acknowledges the previous one.
    pub nodelay: bool,
}

impl Limits {
    /// A probe or metrics port: a few connections at once, a bounded wait for the request head.
    pub fn probes(header_read_timeout: Duration) -> Self {
        Self {
            max_connections: PROBE_MAX_CONNECTIONS,
            header_read_timeout: Some(header_read_timeout),
            nodelay: false,
        }
    }
}

/// Connections open at once on a probe or metrics port (probes and scrapes need a few).
pub const PROBE_MAX_CONNECTIONS: usize = 64;

/// Serve `listener` with the service `make` returns for each connection until `shutdown`
/// completes.
pub async fn serve<M, S, B>(
    listener: TcpListener,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
    mut make: M,
) where
    M: FnMut() -> S,
    S: Service<Request<Incoming>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn StdError + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let mut shutdown = std::pin::pin!(shutdown);
    let places = Arc::new(Semaphore::new(
        limits.max_connections.clamp(1, Semaphore::MAX_PERMITS),
    ));
    loop {
        let place = tokio::select! {
            p = places.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return,
            },
            _ = &mut shutdown => return,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            },
            _ = &mut shutdown => return,
        };
        if limits.nodelay {
            if let Err(e) = stream.set_nodelay(true) {
                debug!(%peer, error = %e, "cannot set TCP_NODELAY");
            }
        }
        let service = make();
        tokio::spawn(async move {
            let _place = place;
            let mut builder = hyper::server::conn::http1::Builder::new();
            if let Some(t) = limits.header_read_timeout {
                builder.timer(TokioTimer::new()).header_read_timeout(t);
            }
            if let Err(e) = builder
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}

/// A future that never completes: [`serve`] until the process ends.
pub fn forever() -> impl Future<Output = ()> {
    std::future::pending::<()>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;
    use hyper::body::Bytes;
    use std::convert::Infallible;
    use std::net::SocketAddr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    fn hello() -> impl Service<
        Request<Incoming>,
        Response = Response<Full<Bytes>>,
        Error = Infallible,
        Future = impl Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send,
    > + Send {
        hyper::service::service_fn(|req: Request<Incoming>| async move {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(format!(
                "hello {}",
                req.uri().path()
            )))))
        })
    }

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        out
    }

    async fn listen() -> (TcpListener, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let a = l.local_addr().expect("addr");
        (l, a)
    }

    /// Requests are answered; the loop returns when the shutdown future completes.
    #[tokio::test]
    async fn answers_and_stops_on_shutdown() {
        let (l, addr) = listen().await;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let limits = Limits {
            max_connections: 4,
            header_read_timeout: None,
            nodelay: true,
        };
        let server = tokio::spawn(serve(
            l,
            limits,
            async { stopped.await.unwrap_or(()) },
            hello,
        ));
        assert!(get(addr, "/a").await.ends_with("hello /a"));
        stop.send(()).expect("stop");
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("the loop ends on shutdown")
            .expect("join");
    }

    /// With every place taken, a new connection is not served until one closes.
    #[tokio::test]
    async fn a_full_listener_serves_the_next_connection_when_one_closes() {
        let (l, addr) = listen().await;
        let limits = Limits {
            max_connections: 1,
            header_read_timeout: None,
            nodelay: false,
        };
        tokio::spawn(serve(l, limits, forever(), hello));
        // Holds the only place: connected, no request yet.
        let holder = TcpStream::connect(addr).await.expect("connect");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let waiting = tokio::spawn(get(addr, "/b"));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !waiting.is_finished(),
            "served while the only place was taken"
        );
        drop(holder);
        let body = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("served once the place was free")
            .expect("join");
        assert!(body.ends_with("hello /b"), "{body}");
    }

    /// A client that never sends its request head is dropped after the header timeout.
    #[tokio::test]
    async fn a_silent_client_is_dropped_after_the_header_timeout() {
        let (l, addr) = listen().await;
        tokio::spawn(serve(
            l,
            Limits::probes(Duration::from_millis(200)),
            forever(),
            hello,
        ));
        let mut silent = TcpStream::connect(addr).await.expect("connect");
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf))
            .await
            .expect("the server closed the connection")
            .unwrap_or(0);
        // hyper may answer 408 before closing; either way the connection ends.
        let text = String::from_utf8_lossy(&buf[..n]).to_string();
        assert!(n == 0 || text.starts_with("HTTP/1.1 408"), "{text}");
    }
}
