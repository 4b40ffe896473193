//! What FlexInfer's long-running processes share: start-up and stop ([`process`]) and the one
//! HTTP/1 accept loop ([`server`]) of the controller, the proxy and the serving stand-in.

pub mod process;
pub mod server;
