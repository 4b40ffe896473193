//! Names of the serving Deployment and Service the Model controller renders.

/// `app.kubernetes.io/component` of serving Deployments, Services and pods.
pub const COMPONENT: &str = "inference-server";
/// Port of every backend's OpenAI-compatible HTTP server (container and Service).
pub const PORT: i32 = 8000;
/// Name of that port.
pub const PORT_NAME: &str = "http";
/// Where the artifact is mounted (read-only) in serving pods.
pub const MODEL_MOUNT: &str = "/models";
/// Name of the serving container.
pub const CONTAINER: &str = "server";
/// `HOME` of serving pods: a writable scratch volume (the pod runs as a non-root user that the
/// image may not know, whose home would be `/`).
pub const HOME: &str = "/var/lib/flexinfer-home";
/// Name of that volume.
pub const HOME_VOLUME: &str = "home";
/// The Model field naming the Secret key whose value is the serving backend's own API key: the
/// controller injects it into the serving container, flexinfer-proxy sends it to the backend.
pub const BACKEND_KEY_FIELD: &str = "spec.backendKeySecretRef";
