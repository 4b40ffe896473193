//! OCI artifact layout of a published model: what `publish` writes and `download` of an
//! `oci://` source reads.

/// Manifest `artifactType`.
pub const ARTIFACT_TYPE: &str = "application/vnd.flexinfer.model.v1";
/// Config descriptor media type (the empty JSON `{}`).
pub const EMPTY_CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.empty.v1+json";
/// Media type of each file layer.
pub const FILE_LAYER_MEDIA_TYPE: &str = "application/vnd.flexinfer.model.file.v1";
/// Layer annotation holding the file's relative path (what `oras pull` uses as the file name).
pub const TITLE_ANNOTATION: &str = "org.opencontainers.image.title";
/// Manifest annotation with the source the artifact was built from.
pub const SOURCE_ANNOTATION: &str = "org.opencontainers.image.source";
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
/// Tag policies of `spec.publish.tagPolicy`.
pub const TAG_POLICY_OVERWRITE: &str = "overwrite";
pub const TAG_POLICY_TIMESTAMP: &str = "timestamp";
pub const TAG_POLICY_DIGEST_SUFFIX: &str = "digest-suffix";
