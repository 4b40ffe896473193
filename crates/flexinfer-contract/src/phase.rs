//! The four pipeline phases, as named in Job names, labels, status and worker subcommands.

use serde::{Deserialize, Serialize};

/// Pipeline phases as named in Job names/labels and the worker's subcommands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobPhase {
    Download,
    Abliterate,
    Quantize,
    Publish,
}

impl JobPhase {
    pub const ALL: [JobPhase; 4] = [
        JobPhase::Download,
        JobPhase::Abliterate,
        JobPhase::Quantize,
        JobPhase::Publish,
    ];
    /// Job name suffix, label value and worker subcommand.
    pub fn as_str(self) -> &'static str {
        match self {
            JobPhase::Download => "download",
            JobPhase::Abliterate => "abliterate",
            JobPhase::Quantize => "quantize",
            JobPhase::Publish => "publish",
        }
    }
    /// `status.currentPhase` value and metrics `job_type`.
    pub fn status_name(self) -> &'static str {
        match self {
            JobPhase::Download => "download",
            JobPhase::Abliterate => "abliteration",
            JobPhase::Quantize => "quantization",
            JobPhase::Publish => "publish",
        }
    }
    /// Name of the Job's worker container (`kubectl logs job/<cache>-quantize -c quantizer`).
    pub fn container_name(self) -> &'static str {
        match self {
            JobPhase::Download => "downloader",
            JobPhase::Abliterate => "abliterator",
            JobPhase::Quantize => "quantizer",
            JobPhase::Publish => "publisher",
        }
    }
    /// Name of the Job of this phase for a cache.
    pub fn job_name(self, cache: &str) -> String {
        format!("{cache}-{}", self.as_str())
    }
    /// The caches and phases whose [`Self::job_name`] is `job` (the inverse: one pair at most per
    /// phase; a cache name may itself end in a phase's name).
    pub fn of_job_name(job: &str) -> impl Iterator<Item = (&str, JobPhase)> {
        JobPhase::ALL.into_iter().filter_map(move |phase| {
            let cache = job.strip_suffix(phase.as_str())?.strip_suffix('-')?;
            (!cache.is_empty()).then_some((cache, phase))
        })
    }
    pub fn parse(s: &str) -> Option<JobPhase> {
        JobPhase::ALL
            .into_iter()
            .find(|p| p.as_str() == s || p.status_name() == s)
    }
}

/// The worker subcommand of a `storageStrategy: NodeLocal` cache's node copies; its own subcommands are
/// [`crate::labels::NODE_COPY_FILL`] and [`crate::labels::NODE_COPY_CLEAN`] (the values of the Job's
/// [`crate::labels::NODE_COPY`] label).
pub const NODE_COPY_SUBCOMMAND: &str = "node-copy";

#[cfg(test)]
mod job_name_tests {
    use super::JobPhase;

    #[test]
    fn of_job_name_inverts_job_name() {
        for phase in JobPhase::ALL {
            for cache in ["c", "llama-download", "a-b"] {
                let name = phase.job_name(cache);
                assert!(
                    JobPhase::of_job_name(&name).any(|p| p == (cache, phase)),
                    "{name}"
                );
            }
        }
        assert_eq!(JobPhase::of_job_name("download").count(), 0);
        assert_eq!(JobPhase::of_job_name("-download").count(), 0);
        assert_eq!(JobPhase::of_job_name("c-downloads").count(), 0);
    }
}
