//! Names the controller puts on the objects it owns.

/// Field manager of every object the controller applies (server-side apply).
pub const FIELD_MANAGER: &str = "flexinfer-controller";
/// Finalizer the controller puts on ModelCaches that own a PVC.
pub const FINALIZER_CLEANUP: &str = "flexinfer.ai/modelcache-cleanup";
/// Default toleration added to GPU Jobs: `dedicated=gpu:NoSchedule`.
pub const GPU_TOLERATION_KEY: &str = "dedicated";
pub const GPU_TOLERATION_VALUE: &str = "gpu";
pub const GPU_TOLERATION_EFFECT: &str = "NoSchedule";
/// ServiceAccount of pipeline Jobs when `FLEXINFER_WORKER_SERVICE_ACCOUNT` is unset (the chart
/// creates it).
pub const DEFAULT_WORKER_SERVICE_ACCOUNT: &str = "flexinfer-worker";
