//! Tests of what the controller adds to the planner (`flexinfer-plan`): the watch stores and the
//! metric series. The fixtures are the planner's (`flexinfer_plan::modelcache::testkit`).

use flexinfer_api::contract::JobPhase;
use flexinfer_api::modelcache::CachePhase;
use flexinfer_plan::modelcache::observe::JobState;
use flexinfer_plan::modelcache::plan::plan;
use flexinfer_plan::modelcache::testkit::*;

mod metrics_series;
mod stores;
