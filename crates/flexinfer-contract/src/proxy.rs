//! Names `flexinfer-proxy` uses on the objects it touches.

/// Field manager of the proxy's `status.lastActiveTime` writes.
pub const FIELD_MANAGER: &str = "flexinfer-proxy";
/// Label an EndpointSlice carries naming its Service (set by Kubernetes' EndpointSlice controller).
pub const ENDPOINTSLICE_SERVICE_LABEL: &str = "kubernetes.io/service-name";
