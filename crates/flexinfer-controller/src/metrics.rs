//! Prometheus metrics (the names and labels the chart's alerts and dashboards use).

use prometheus::core::Collector;
use prometheus::{
    histogram_opts, opts, GaugeVec, HistogramVec, IntCounterVec, IntGaugeVec, Registry,
};

/// `c`, registered in `registry`.
fn registered<C: Collector + Clone + 'static>(
    registry: &Registry,
    c: Result<C, prometheus::Error>,
) -> Result<C, prometheus::Error> {
    let c = c?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

/// Every metric the controller exports.
#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    /// `flexinfer_job_progress_ratio{model,namespace,job_type}` (0-1).
    pub job_progress_ratio: GaugeVec,
    /// `flexinfer_job_progress_percent{model,namespace,job_type}` (0-100): deprecated for
    /// `flexinfer_job_progress_ratio`, exported beside it for one release.
    pub job_progress_percent: GaugeVec,
    /// `flexinfer_quantization_layer_index{model,namespace}`.
    pub quantization_layer_index: IntGaugeVec,
    /// `flexinfer_quantization_layers{model,namespace}`.
    pub quantization_layers: IntGaugeVec,
    /// `flexinfer_quantization_layer_total{model,namespace}`: deprecated for `flexinfer_quantization_layers`
    /// (a gauge, which a `_total` name says it is not), exported beside it for one release.
    pub quantization_layer_total: IntGaugeVec,
    /// `flexinfer_job_deadline_seconds{model,namespace,job_type}` (activeDeadlineSeconds).
    pub job_deadline_seconds: GaugeVec,
    /// `flexinfer_job_elapsed_seconds{model,namespace,job_type}`.
    pub job_elapsed_seconds: GaugeVec,
    /// `flexinfer_quantization_last_progress_timestamp_seconds{model,namespace}`.
    pub quantization_last_progress_timestamp: GaugeVec,
    /// `flexinfer_quantization_on_cpu{model,namespace}`: while a quantize Job runs, 1 when the cache asked for
    /// a GPU (`useGPU`) and its GPTQ solves run on the CPU although the worker was not told `GPTQ_DEVICE=cpu`,
    /// else 0; absent until the worker has reported its device, and once the Job ends.
    pub quantization_on_cpu: IntGaugeVec,
    /// `flexinfer_quantization_duration_seconds{namespace}`: one histogram per namespace (a histogram per
    /// cache was 14 series for the one value each cache observes).
    pub quantization_duration_seconds: HistogramVec,
    /// `flexinfer_model_cache_failures_total{model,namespace,reason}`.
    pub model_cache_failures_total: IntCounterVec,
    /// `flexinfer_modelcache_phase{cache,namespace,phase}` (1, for the current phase only),
    /// `flexinfer_quantization_jobs_total{model,namespace,status}` and
    /// `flexinfer_quantization_compression_ratio{model,namespace}`: one compact row per cache.
    pub caches: std::sync::Arc<crate::cache_series::CacheSeries>,
    /// `flexinfer_model_phase{model,namespace,phase}` (1 for the current phase, else 0).
    pub model_phase: IntGaugeVec,
    /// `flexinfer_model_phase_transitions_total{model,namespace,from,to}`.
    pub model_phase_transitions_total: IntCounterVec,
    /// `flexinfer_model_preemptions_total{model,namespace,group}`: times a Model of a shared GPU
    /// group lost its lane to a higher-priority one.
    pub model_preemptions_total: IntCounterVec,
    /// `flexinfer_reconcile_duration_seconds{controller}`.
    pub reconcile_duration_seconds: HistogramVec,
    /// `flexinfer_reconciles_total{controller}`: finished reconcile calls, success or error (a
    /// panic included).
    pub reconciles_total: IntCounterVec,
    /// `flexinfer_reconcile_errors_total{controller}`.
    pub reconcile_errors_total: IntCounterVec,
    /// `flexinfer_reconcile_retries_total{controller,reason}`: reconciles that ended early to run again
    /// shortly without counting as a failure: `conflict` (a conditional write found a newer object
    /// than the plan was made from: the write was wasted) and `store_behind` (a Job write of ours
    /// was not in the watch yet).
    pub reconcile_retries_total: IntCounterVec,
    /// `flexinfer_watch_store_objects{controller,kind}`: objects the controller's watch stores hold
    /// (set after each reconcile), what its memory grows with.
    pub watch_store_objects: IntGaugeVec,
}

impl Metrics {
    /// Create and register every metric in a fresh registry.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let mj = ["model", "namespace", "job_type"];
        let mn = ["model", "namespace"];
        Ok(Metrics {
            caches: crate::cache_series::CacheSeries::registered(&registry)?,
            job_progress_ratio: registered(
                &registry,
                GaugeVec::new(
                    opts!(
                        "flexinfer_job_progress_ratio",
                        "Progress of the running pipeline Job (0-1)"
                    ),
                    &mj,
                ),
            )?,
            job_progress_percent: registered(
                &registry,
                GaugeVec::new(
                    opts!(
                        "flexinfer_job_progress_percent",
                        "Deprecated: flexinfer_job_progress_ratio x 100; removed in the next release"
                    ),
                    &mj,
                ),
            )?,
            quantization_layer_index: registered(
                &registry,
                IntGaugeVec::new(
                    opts!(
                        "flexinfer_quantization_layer_index",
                        "Decoder layer the quantizer is working on"
                    ),
                    &mn,
                ),
            )?,
            quantization_layers: registered(
                &registry,
                IntGaugeVec::new(
                    opts!(
                        "flexinfer_quantization_layers",
                        "Decoder layers of the model being quantized"
                    ),
                    &mn,
                ),
            )?,
            quantization_layer_total: registered(
                &registry,
                IntGaugeVec::new(
                    opts!(
                        "flexinfer_quantization_layer_total",
                        "Deprecated: flexinfer_quantization_layers; removed in the next release"
                    ),
                    &mn,
                ),
            )?,
            job_deadline_seconds: registered(
                &registry,
                GaugeVec::new(
                    opts!(
                        "flexinfer_job_deadline_seconds",
                        "activeDeadlineSeconds of the running pipeline Job"
                    ),
                    &mj,
                ),
            )?,
            job_elapsed_seconds: registered(
                &registry,
                GaugeVec::new(
                    opts!(
                        "flexinfer_job_elapsed_seconds",
                        "Seconds since the running pipeline Job started"
                    ),
                    &mj,
                ),
            )?,
            quantization_last_progress_timestamp: registered(
                &registry,
                GaugeVec::new(
                    opts!(
                        "flexinfer_quantization_last_progress_timestamp_seconds",
                        "Unix time of the last quantization layer progress"
                    ),
                    &mn,
                ),
            )?,
            quantization_duration_seconds: registered(
                &registry,
                HistogramVec::new(
                    histogram_opts!(
                        "flexinfer_quantization_duration_seconds",
                        "Wall time of successful quantization runs, per namespace",
                        vec![
                            60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0, 57600.0,
                            86400.0, 172800.0
                        ]
                    ),
                    &["namespace"],
                ),
            )?,
            quantization_on_cpu: registered(
                &registry,
                IntGaugeVec::new(
                    opts!(
                        "flexinfer_quantization_on_cpu",
                        "1 while a useGPU quantization runs its GPTQ solves on the CPU without GPTQ_DEVICE=cpu, else 0"
                    ),
                    &mn,
                ),
            )?,
            model_cache_failures_total: registered(
                &registry,
                IntCounterVec::new(
                    opts!(
                        "flexinfer_model_cache_failures_total",
                        "Pipeline phase failures by reason"
                    ),
                    &["model", "namespace", "reason"],
                ),
            )?,
            model_phase: registered(
                &registry,
                IntGaugeVec::new(
                    opts!(
                        "flexinfer_model_phase",
                        "Current phase of each Model (1 = current)"
                    ),
                    &["model", "namespace", "phase"],
                ),
            )?,
            model_phase_transitions_total: registered(
                &registry,
                IntCounterVec::new(
                    opts!(
                        "flexinfer_model_phase_transitions_total",
                        "Model phase transitions"
                    ),
                    &["model", "namespace", "from", "to"],
                ),
            )?,
            model_preemptions_total: registered(
                &registry,
                IntCounterVec::new(
                    opts!(
                    "flexinfer_model_preemptions_total",
                    "Times a Model of a shared GPU group was preempted by a higher-priority one"
                ),
                    &["model", "namespace", "group"],
                ),
            )?,
            reconcile_duration_seconds: registered(
                &registry,
                HistogramVec::new(
                    histogram_opts!(
                        "flexinfer_reconcile_duration_seconds",
                        "Duration of one reconcile",
                        vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
                    ),
                    &["controller"],
                ),
            )?,
            reconciles_total: registered(
                &registry,
                IntCounterVec::new(
                    opts!(
                        "flexinfer_reconciles_total",
                        "Finished reconciles (success or error)"
                    ),
                    &["controller"],
                ),
            )?,
            reconcile_errors_total: registered(
                &registry,
                IntCounterVec::new(
                    opts!("flexinfer_reconcile_errors_total", "Failed reconciles"),
                    &["controller"],
                ),
            )?,
            reconcile_retries_total: registered(
                &registry,
                IntCounterVec::new(
                    opts!(
                        "flexinfer_reconcile_retries_total",
                        "Reconciles run again shortly without counting as failed, by reason (conflict, store_behind)"
                    ),
                    &["controller", "reason"],
                ),
            )?,
            watch_store_objects: registered(
                &registry,
                IntGaugeVec::new(
                    opts!(
                        "flexinfer_watch_store_objects",
                        "Objects held in the controller's watch stores, by kind"
                    ),
                    &["controller", "kind"],
                ),
            )?,
            registry,
        })
    }

    /// Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let enc = prometheus::TextEncoder::new();
        if prometheus::Encoder::encode(&enc, &self.registry.gather(), &mut buf).is_err() {
            return String::new();
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}
