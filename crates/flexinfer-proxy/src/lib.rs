//! `flexinfer-proxy`: one OpenAI-compatible gateway in front of every Model (docs/user/serving.md,
//! "The proxy"; docs/dev/architecture.md).
//!
//! Pure decisions (`route`, `endpoints`, `plan`, `auth`) are table-tested; `cluster` holds the
//! watch-based caches and the `status.lastActiveTime` writer; `backend_keys` the serving backends'
//! own API keys read from Secrets; `activity` counts in-flight requests
//! and drives the keepalive; `server` is the HTTP front (hyper).
// Integer overflow from user or model values must be an error or saturate, never wrap or panic.
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

pub mod activity;
pub mod auth;
pub mod backend_keys;
pub mod body;
pub mod cluster;
pub mod endpoints;
pub mod limits;
pub mod metrics;
pub mod openai;
pub mod peek;
pub mod plan;
pub mod route;
pub mod server;

pub use cluster::Cluster;
pub use server::{serve, Config, Proxy};
