//! Commands that talk to the API server: `quantize`, `quantize status`, `quantize recommend`,
//! `cache status`.
//!
//! `mod.rs`: the connection and `quantize`; [`status`]: `quantize status` and `cache status`;
//! [`recommend_cmd`]: `quantize recommend`.

mod recommend_cmd;
mod status;

pub use recommend_cmd::recommend;
pub use status::{cache_status, quantize_status};

use anyhow::{anyhow, Context};
use flexinfer_api::formats::FormatInfo;
use flexinfer_api::ModelCache;
use kube::api::{Api, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::args::{Global, QuantizeRequest};
use crate::output::{self, Format};
use crate::{bad, CliError};

/// A client and the effective namespace, like kubectl.
pub async fn connect(g: &Global) -> anyhow::Result<(Client, String)> {
    let opts = KubeConfigOptions {
        context: g.context.clone(),
        cluster: None,
        user: None,
    };
    let config = match &g.kubeconfig {
        Some(p) => {
            let kc = Kubeconfig::read_from(p)
                .with_context(|| format!("read kubeconfig {}", p.display()))?;
            Config::from_custom_kubeconfig(kc, &opts).await
        }
        None => Config::from_kubeconfig(&opts).await,
    }
    .context("load kubeconfig (set --kubeconfig or KUBECONFIG)")?;
    let ns = g
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config).context("build the API client")?;
    Ok((client, ns))
}

pub(super) async fn get_cache(
    api: &Api<ModelCache>,
    name: &str,
    ns: &str,
) -> Result<ModelCache, CliError> {
    match api.get_opt(name).await {
        Ok(Some(c)) => Ok(c),
        Ok(None) => Err(CliError::Failed(anyhow!(
            "modelcache {name} not found in namespace {ns}"
        ))),
        Err(e) => Err(CliError::Failed(anyhow!("get modelcache {ns}/{name}: {e}"))),
    }
}

/// `flexinfer quantize <cache> --format ...`.
pub async fn quantize(
    g: &Global,
    r: &QuantizeRequest,
    info: &FormatInfo,
) -> Result<String, CliError> {
    let name = r.cache.clone().unwrap_or_default();
    let (client, ns) = connect(g).await?;
    let api: Api<ModelCache> = Api::namespaced(client, &ns);
    get_cache(&api, &name, &ns).await?;
    let patch = crate::request::request_patch(r, info);
    let updated = api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) if s.code == 422 || s.code == 400 => bad(format!(
                "the API server rejected the request: {}",
                s.message
            )),
            e => CliError::Failed(anyhow!("patch modelcache {ns}/{name}: {e}")),
        })?;
    if g.output != Format::Table {
        return Ok(output::structured(g.output, &updated.spec.quantization)?);
    }
    let q = updated.spec.quantization.as_ref();
    let mut s = format!(
        "modelcache/{name} quantization requested: {}",
        q.map(describe_spec)
            .unwrap_or_else(|| info.name.to_string())
    );
    s.push('\n');
    if !info.implemented {
        s.push_str(&format!(
            "note: {} has no built-in engine yet (planned); the phase will fail with UnsupportedFormat\n",
            info.name
        ));
    }
    s.push_str(&format!(
        "Watch progress:\n  flexinfer quantize status {name} -n {ns}\n  kubectl get modelcache {name} -n {ns} -w\n"
    ));
    Ok(s)
}

pub(super) fn describe_spec(q: &flexinfer_api::modelcache::QuantizationSpec) -> String {
    let fmt = flexinfer_api::formats::info(q.format).name;
    let mut s = format!("{fmt} {}", q.output_subdir());
    if fmt == "GPTQ" || fmt == "AWQ" {
        s.push_str(&format!(
            " (bits {}, groupSize {}, sym {}, descAct {}, dynamicExclusion {})",
            q.effective_bits(),
            q.group_size,
            q.sym,
            q.desc_act,
            q.dynamic_exclusion.as_str()
        ));
    }
    if q.format == flexinfer_api::modelcache::QuantFormat::Gguf {
        // The controller runs GGUF on a CPU node whatever useGPU says.
        s.push_str(" on the CPU (the GGUF engine has no GPU path)");
    } else if q.use_gpu {
        s.push_str(" on GPU");
    }
    s
}
