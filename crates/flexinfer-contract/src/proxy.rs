//! Names `flexinfer-proxy` uses on the objects it touches.

/// Field manager of the proxy's `status.lastActiveTime` writes.
pub const FIELD_MANAGER: &str = "flexinfer-proxy";
/// Label an EndpointSlice carries naming its Service (set by Kubernetes' EndpointSlice controller).
pub const ENDPOINTSLICE_SERVICE_LABEL: &str = "kubernetes.io/service-name";
/// Label naming who manages an EndpointSlice (set by Kubernetes' EndpointSlice controller).
pub const ENDPOINTSLICE_MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// [`ENDPOINTSLICE_MANAGED_BY_LABEL`] on the slices Kubernetes computes from a Service's pods: the
/// only slices whose addresses the proxy uses.
pub const ENDPOINTSLICE_CONTROLLER: &str = "endpointslice-controller.k8s.io";
/// The field of a line of the proxy's API-keys file that gives a key the namespaces it may reach:
/// `<key> namespaces=<namespace>,<namespace>`.
pub const KEY_NAMESPACES_FIELD: &str = "namespaces=";
