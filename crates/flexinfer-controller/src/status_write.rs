//! The one status write of both reconcilers: a server-side apply of the status subresource under
//! the controller's field manager, conditional on the resourceVersion the plan was made from.

use kube::api::{Patch, PatchParams};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::reconcile_error::Error;
use flexinfer_api::contract::controller::FIELD_MANAGER;

/// Apply `status` (the fields the controller owns) to `name`'s status, conditional on
/// `resource_version` when given: a plan made from a stale object must not overwrite a newer status
/// (409 → [`Error::Conflict`]; the reconcile runs again with the fresh object). Returns the object
/// as the API server wrote it.
pub async fn apply_status<K>(
    api: &Api<K>,
    name: &str,
    resource_version: Option<&str>,
    status: serde_json::Value,
) -> Result<K, Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut patch = json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    if let Some(rv) = resource_version {
        patch["metadata"] = json!({ "resourceVersion": rv });
    }
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(Error::of_write)
}
