//! `flexinfer-standin`: a small OpenAI-compatible server for local clusters without vLLM.
//!
//! It accepts the command line the Model controller renders for the `vllm` backend
//! (`python3 -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME --port P …`; in the
//! stand-in image `python3` is this binary), loads the artifact with the engine's own reader (config,
//! safetensors shards, GPTQ `qweight/qzeros/scales/g_idx` dequantized to f32, `tokenizer.json`), verifies its
//! `.save-complete` record (sizes and sha256) when there is one, and answers `/health`, `/v1/models`,
//! `/v1/completions` and `/v1/chat/completions` (also as SSE streams) with greedy decoding through the
//! engine's Llama-family forward. It is meant for tests and demos of tiny models: every generated token runs
//! the whole sequence again, on the CPU.

// Integer overflow from request or model values must be an error or saturate, never wrap or panic.
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use faer::Mat;
use flexinfer_contract::error::chain;
use flexinfer_quant::llama::{embed, layer_forward, linear, lm_head, rms_norm, Rope};
use flexinfer_quant::model::{load_layer, GptqReadConfig, LayerWeights, Linear, ModelConfig};
use flexinfer_quant::tensors::TensorStore;
use flexinfer_quant::writer::verify_save_complete;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};

/// Largest request body read (bytes).
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Upper bound of `max_tokens`.
pub const MAX_NEW_TOKENS: usize = 256;
/// Upper bound of prompt + generated tokens (the forward is quadratic in it).
pub const MAX_CONTEXT: usize = 2048;

/// What the stand-in understood of its command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    pub model: PathBuf,
    pub served_model_name: Option<String>,
    pub host: String,
    pub port: u16,
    /// `--token-delay-ms`: a pause before each streamed token, to stand in for a slow model (long
    /// streams in tests of keepalive, back-pressure and replica failure). Default 0.
    pub token_delay: std::time::Duration,
    /// vLLM flags it accepts and ignores (logged at start).
    pub ignored: Vec<String>,
}

/// Parses vLLM's spelling (`--flag value` or `--flag=value`; `-m module` and unknown flags are accepted and
/// ignored, so the Model controller's rendering works unchanged).
pub fn parse_args<I: IntoIterator<Item = String>>(argv: I) -> Result<Args, StandinError> {
    let mut model = None;
    let mut name = None;
    let mut host = "0.0.0.0".to_string();
    let mut port = 8000u16;
    let mut token_delay = std::time::Duration::ZERO;
    let mut ignored = Vec::new();
    let mut it = argv.into_iter().peekable();
    while let Some(a) = it.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        let takes_value = |f: &str| !matches!(f, "--trust-remote-code" | "--enforce-eager");
        let next_is_value = it.peek().is_some_and(|n| !n.starts_with("--"));
        let mut value = |flag: &str| -> Result<String, StandinError> {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or_else(|| StandinError::Usage(format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--model" => model = Some(PathBuf::from(value("--model")?)),
            "--served-model-name" => name = Some(value("--served-model-name")?),
            "--host" => host = value("--host")?,
            "--port" => {
                let v = value("--port")?;
                port = v.parse().map_err(|_| {
                    StandinError::Usage(format!("--port must be a port number, got {v:?}"))
                })?;
            }
            "--token-delay-ms" => {
                let v = value("--token-delay-ms")?;
                let ms: u64 = v.parse().ok().filter(|ms| *ms <= 60_000).ok_or_else(|| {
                    StandinError::Usage(format!("--token-delay-ms must be 0 to 60000, got {v:?}"))
                })?;
                token_delay = std::time::Duration::from_millis(ms);
            }
            "-m" => ignored.push(format!("-m {}", value("-m")?)),
            f if f.starts_with('-') => {
                if inline.is_some() || (takes_value(f) && next_is_value) {
                    ignored.push(format!("{f} {}", value(f)?));
                } else {
                    ignored.push(f.to_string());
                }
            }
            other => ignored.push(other.to_string()),
        }
    }
    let model = model.ok_or_else(|| StandinError::Usage("--model DIR is required".into()))?;
    Ok(Args {
        model,
        served_model_name: name,
        host,
        port,
        token_delay,
        ignored,
    })
}

/// A loaded artifact: its layers dequantized to f32 once.
pub struct Engine {
    cfg: ModelConfig,
    store: TensorStore,
    layers: Vec<LayerWeights>,
    head: Linear,
    norm: Vec<f32>,
    tokenizer: flexinfer_quant::calib::Tokenizer,
    /// What `/v1/models` reports about the artifact.
    pub info: Value,
}

/// A stand-in failure; its text is what the log line or the HTTP error body shows.
#[derive(Debug, thiserror::Error)]
pub enum StandinError {
    /// A command-line flag that is missing or does not parse (the text names it).
    #[error("{0}")]
    Usage(String),
    /// The artifact's `.save-complete` does not match its files.
    #[error(
        "{}: does not match the files (a shard is missing, truncated or has another sha256)",
        .0.display()
    )]
    Unverified(PathBuf),
    /// The engine cannot load the artifact or run the prompt.
    #[error(transparent)]
    Engine(#[from] flexinfer_quant::QuantError),
    /// A token id beyond `u32`.
    #[error(transparent)]
    TokenId(#[from] std::num::TryFromIntError),
    /// A request the stand-in cannot serve (the text says why).
    #[error("{0}")]
    Request(String),
    /// `--host`/`--port` do not form an address.
    #[error("--host/--port")]
    Address(#[source] std::net::AddrParseError),
    /// The listening socket cannot be bound.
    #[error("bind {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

impl Engine {
    /// Loads `dir`; refuses an artifact whose `.save-complete` does not verify.
    pub fn load(dir: &Path) -> Result<Self, StandinError> {
        let sc_path = dir.join(flexinfer_contract::files::SAVE_COMPLETE);
        let verified = if sc_path.exists() {
            let sc = verify_save_complete(dir, true)
                .ok_or_else(|| StandinError::Unverified(sc_path.clone()))?;
            Some(sc.shards.len())
        } else {
            None
        };
        let cfg = ModelConfig::load(dir)?;
        let store = TensorStore::open_dir(dir)?;
        let gq = GptqReadConfig::from_config(&cfg);
        let layers = (0..cfg.num_layers)
            .map(|l| load_layer(&store, &cfg, l, gq))
            .collect::<Result<Vec<_>, _>>()?;
        let head = lm_head(&store, &cfg)?;
        let norm = store.f32("model.norm.weight")?;
        let tokenizer = flexinfer_quant::calib::load_tokenizer(dir)?;
        let qc = cfg.raw.get("quantization_config").cloned();
        let info = json!({
            "architecture": cfg.architecture,
            "layers": cfg.num_layers,
            "hiddenSize": cfg.hidden_size,
            "quantization": qc,
            "verifiedShards": verified,
        });
        Ok(Engine {
            cfg,
            store,
            layers,
            head,
            norm,
            tokenizer,
            info,
        })
    }

    fn next_token(&self, tokens: &[u32]) -> Result<u32, StandinError> {
        let rope = Rope::new(&self.cfg, tokens.len());
        let mut x = embed(&self.store, &self.cfg, None, tokens)?;
        for lw in &self.layers {
            x = layer_forward(&self.cfg, lw, x.as_ref(), &rope, None);
        }
        let last = x
            .nrows()
            .checked_sub(1)
            .ok_or_else(|| StandinError::Request("empty prompt".into()))?;
        let xl = Mat::from_fn(1, x.ncols(), |_, c| x[(last, c)]);
        let xn = rms_norm(xl.as_ref(), &self.norm, self.cfg.rms_norm_eps);
        let logits = linear(xn.as_ref(), &self.head);
        let mut best = (0u32, f32::NEG_INFINITY);
        for c in 0..logits.ncols() {
            let v = logits[(0, c)];
            if v > best.1 {
                best = (u32::try_from(c)?, v);
            }
        }
        Ok(best.0)
    }

    /// Greedy decoding; `on_piece` gets the text of each new token as it is produced and returns whether to
    /// go on (a streaming client that went away ends the generation).
    pub fn generate(
        &self,
        prompt: &str,
        max_tokens: usize,
        mut on_piece: impl FnMut(&str) -> bool,
    ) -> Result<Generation, StandinError> {
        let mut tokens = flexinfer_quant::calib::encode(&self.tokenizer, prompt, "the prompt")?;
        if tokens.is_empty() {
            return Err(StandinError::Request("the prompt has no tokens".into()));
        }
        let prompt_tokens = tokens.len();
        let max_tokens = max_tokens.min(MAX_NEW_TOKENS);
        if prompt_tokens.saturating_add(max_tokens) > MAX_CONTEXT {
            return Err(StandinError::Request(format!(
                "prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the stand-in's context of {MAX_CONTEXT}"
            )));
        }
        let mut text = String::new();
        let mut completion_tokens = 0usize;
        while completion_tokens < max_tokens {
            let t = self.next_token(&tokens)?;
            tokens.push(t);
            completion_tokens = completion_tokens.saturating_add(1);
            let piece = self
                .tokenizer
                .decode(&[t], false)
                .map(|p| format!(" {p}"))
                .unwrap_or_default();
            text.push_str(&piece);
            if !on_piece(&piece) {
                break;
            }
        }
        Ok(Generation {
            text,
            prompt_tokens,
            completion_tokens,
        })
    }
}

/// One finished generation.
#[derive(Debug, Clone)]
pub struct Generation {
    pub text: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed()
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(full(v.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// An error in OpenAI's shape.
fn error(status: StatusCode, kind: &str, message: &str) -> Response<Body> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": kind, "param": null, "code": null}}),
    )
}

/// The state every request sees.
pub struct Server {
    pub engine: Engine,
    pub served_name: String,
    pub created: i64,
    /// Pause before each streamed token (`--token-delay-ms`).
    pub token_delay: std::time::Duration,
}

/// The prompt of a completion or chat request: chat messages are joined by newlines.
fn prompt_of(chat: bool, body: &Value) -> Result<String, StandinError> {
    let bad = |m: &str| StandinError::Request(m.to_string());
    if chat {
        let msgs = body
            .get("messages")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("messages must be an array"))?;
        let parts: Vec<&str> = msgs
            .iter()
            .filter_map(|m| m.get("content").and_then(Value::as_str))
            .collect();
        if parts.is_empty() {
            return Err(bad("messages hold no text content"));
        }
        Ok(parts.join("\n"))
    } else {
        match body.get("prompt") {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                Ok(a[0].as_str().unwrap_or_default().to_string())
            }
            _ => Err(bad("prompt must be a string")),
        }
    }
}

impl Server {
    fn models(&self) -> Value {
        json!({"object": "list", "data": [{
            "id": self.served_name, "object": "model", "created": self.created,
            "owned_by": "flexinfer-standin", "artifact": self.engine.info,
        }]})
    }

    fn choice(chat: bool, text: &str, finish: Option<&str>, stream: bool) -> Value {
        match (chat, stream) {
            (true, false) => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
            }
            (true, true) => {
                json!({"index": 0, "delta": {"content": text}, "finish_reason": finish})
            }
            (false, _) => {
                json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null})
            }
        }
    }

    /// Handles one request (routing, validation, generation).
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<Body>, Infallible> {
        let path = req.uri().path().to_string();
        let method = req.method().clone();
        Ok(match (method, path.as_str()) {
            (Method::GET, "/health") | (Method::GET, "/healthz") => Response::new(full("")),
            (Method::GET, "/v1/models") => json_response(StatusCode::OK, &self.models()),
            (Method::POST, "/v1/completions") => self.complete(req, false).await,
            (Method::POST, "/v1/chat/completions") => self.complete(req, true).await,
            _ => error(
                StatusCode::NOT_FOUND,
                "not_found_error",
                &format!("no route {path}"),
            ),
        })
    }

    async fn complete(self: Arc<Self>, req: Request<Incoming>, chat: bool) -> Response<Body> {
        let ask = match self.read_request(req, chat).await {
            Ok(a) => a,
            Err(refused) => return refused,
        };
        let object = match (chat, ask.stream) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        };
        let head = Head {
            id: format!("cmpl-standin-{}", jiff::Timestamp::now().as_nanosecond()),
            object,
            created: jiff::Timestamp::now().as_second(),
            chat,
        };
        if ask.stream {
            self.stream(ask, head)
        } else {
            self.answer(ask, head).await
        }
    }

    /// The request's body read (bounded), parsed and checked: the served model, the prompt, `max_tokens`
    /// (or `max_completion_tokens`) and `stream`. A refusal is the OpenAI-style error response.
    async fn read_request(
        &self,
        req: Request<Incoming>,
        chat: bool,
    ) -> Result<Ask, Response<Body>> {
        let invalid = |status, m: &str| error(status, "invalid_request_error", m);
        let bytes = match Limited::new(req.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
        {
            Ok(b) => b.to_bytes(),
            Err(_) => {
                return Err(invalid(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &format!("request body over {MAX_BODY_BYTES} bytes or unreadable"),
                ))
            }
        };
        let body: Value = serde_json::from_slice(&bytes)
            .map_err(|e| invalid(StatusCode::BAD_REQUEST, &format!("body is not JSON: {e}")))?;
        let model = body
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if model != self.served_name {
            return Err(invalid(
                StatusCode::NOT_FOUND,
                &format!(
                    "The model `{model}` does not exist; this server serves `{}`",
                    self.served_name
                ),
            ));
        }
        let prompt =
            prompt_of(chat, &body).map_err(|e| invalid(StatusCode::BAD_REQUEST, &chain(&e)))?;
        let max_tokens = body
            .get("max_tokens")
            .or_else(|| body.get("max_completion_tokens"))
            .and_then(Value::as_u64)
            .map_or(16, |n| usize::try_from(n).unwrap_or(MAX_NEW_TOKENS));
        let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
        Ok(Ask {
            prompt,
            max_tokens,
            stream,
        })
    }

    /// The whole completion in one JSON response.
    async fn answer(self: Arc<Self>, ask: Ask, head: Head) -> Response<Body> {
        let me = self.clone();
        let gen = tokio::task::spawn_blocking(move || {
            me.engine.generate(&ask.prompt, ask.max_tokens, |_| true)
        })
        .await;
        match gen {
            Ok(Ok(g)) => json_response(
                StatusCode::OK,
                &json!({
                    "id": head.id, "object": head.object, "created": head.created, "model": self.served_name,
                    "system_fingerprint": "flexinfer-standin",
                    "choices": [Self::choice(head.chat, &g.text, Some("length"), false)],
                    "usage": {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens,
                              "total_tokens": g.prompt_tokens.saturating_add(g.completion_tokens)},
                }),
            ),
            Ok(Err(e)) => error(StatusCode::BAD_REQUEST, "invalid_request_error", &chain(&e)),
            Err(e) => error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                &e.to_string(),
            ),
        }
    }

    /// SSE: one chunk per token, then the final chunk and `[DONE]`. A closed client ends the generation.
    fn stream(self: Arc<Self>, ask: Ask, head: Head) -> Response<Body> {
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let chunk = |text: &str, finish: Option<&str>| {
                let v = json!({"id": head.id, "object": head.object, "created": head.created,
                               "model": me.served_name, "system_fingerprint": "flexinfer-standin",
                               "choices": [Self::choice(head.chat, text, finish, true)]});
                Bytes::from(format!("data: {v}\n\n"))
            };
            // A failed send means the client closed the stream: generation stops there.
            let r = me.engine.generate(&ask.prompt, ask.max_tokens, |piece| {
                if !me.token_delay.is_zero() {
                    std::thread::sleep(me.token_delay);
                }
                tx.blocking_send(chunk(piece, None)).is_ok()
            });
            let tail = match r {
                Ok(_) => chunk("", Some("length")),
                Err(e) => Bytes::from(format!(
                    "data: {}\n\n",
                    json!({"error": {"message": chain(&e), "type": "invalid_request_error"}})
                )),
            };
            let _ = tx.blocking_send(tail);
            let _ = tx.blocking_send(Bytes::from_static(b"data: [DONE]\n\n"));
        });
        let s = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
        });
        let mut r = Response::new(StreamBody::new(s).boxed());
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/event-stream"),
        );
        r
    }
}

/// A completion request, read and checked.
struct Ask {
    prompt: String,
    max_tokens: usize,
    stream: bool,
}

/// What every response object of one request repeats.
struct Head {
    id: String,
    object: &'static str,
    created: i64,
    chat: bool,
}

/// Loads the artifact and serves until the process is stopped.
pub async fn serve(args: Args) -> Result<(), StandinError> {
    let engine = Engine::load(&args.model)?;
    let served_name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| args.model.display().to_string());
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .map_err(StandinError::Address)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| StandinError::Bind { addr, source })?;
    eprintln!(
        "{}",
        json!({"event": "standin_ready", "model": served_name, "dir": args.model, "listen": addr.to_string(),
               "artifact": engine.info, "ignoredArgs": args.ignored,
               "note": "flexinfer-standin: greedy CPU decoding through the engine's reader, not vLLM"})
    );
    let server = Arc::new(Server {
        engine,
        served_name,
        created: jiff::Timestamp::now().as_second(),
        token_delay: args.token_delay,
    });
    // No header timeout: a test may hold a connection open as long as it likes.
    let limits = flexinfer_runtime::server::Limits {
        max_connections: tokio::sync::Semaphore::MAX_PERMITS,
        header_read_timeout: None,
        nodelay: false,
    };
    flexinfer_runtime::server::serve(
        listener,
        limits,
        flexinfer_runtime::server::forever(),
        || {
            let server = server.clone();
            hyper::service::service_fn(move |req| server.clone().handle(req))
        },
    )
    .await;
    Ok(())
}

#[cfg(test)]
mod tests;
