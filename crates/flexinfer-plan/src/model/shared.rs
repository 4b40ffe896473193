//! Shared GPU groups (docs/dev/architecture.md, "Shared GPU groups"): the Models of one namespace with the same
//! `spec.gpu.shared` take turns on one GPU lane. Pure: [`arbitrate`] decides, from what each member
//! wants on its own and what its Deployment runs now, which member holds the lane and how many
//! replicas each may have.
//!
//! Rules:
//! - A member *wants* the lane when its own replica policy (serverless, warm policy, the gate)
//!   asks for at least one replica.
//! - Of the members that want it, the one with the highest `gpu.priority` gets it. Equal priority
//!   never preempts: the member that runs now keeps the lane; otherwise the one that held it last
//!   (`Active` in its status), then the name decides.
//! - The lane is handed over only when every other member runs no pod (Deployment spec and status
//!   both at zero replicas); until then the new holder waits as `Queued`, first in line.
//! - A member that runs and loses the lane to a higher-priority one is `Preempted`: it keeps its
//!   replicas while it is busy (requests seen within its keepalive window) for at most the grace
//!   period after the preemption began, then goes to zero. A member that runs but wants nothing any
//!   more (idled out) goes to zero at once.
//! - Members that want the lane and wait are `Queued` (or stay `Preempted` while the Model that
//!   took their lane holds it), with their place in line; members that want nothing are `Idle`.
//!
//! At most one member runs at any time the arbitration is applied by every member's reconcile;
//! two reconciles that read each other's state at the same instant may both start for one round
//! (the next reconcile of either resolves it), and on one physical GPU the scheduler keeps the
//! second pod pending meanwhile.

use std::cmp::Reverse;
use std::time::Duration;

use flexinfer_api::model::SharedGroupState;
use k8s_openapi::jiff::Timestamp;

/// How long a preempted Model keeps serving in-flight requests, unless configured.
pub const DEFAULT_PREEMPTION_GRACE: Duration = Duration::from_secs(30);
/// How soon a Model waiting for another one to release the lane looks again (the Deployment watch
/// usually wakes it first).
pub const HANDOVER_POLL: Duration = Duration::from_secs(5);

/// One member of a group as observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    pub priority: i32,
    /// Replicas the Model's own policy asks for (before arbitration).
    pub wanted: i32,
    /// Replicas its Deployment asks for or still has: max(spec.replicas, status.replicas).
    pub running: i32,
    /// Whether requests were seen within its keepalive window (the proxy refreshes
    /// `lastActiveTime` at that pace while requests are in flight).
    pub busy: bool,
    /// State and transition time from its status, if it had one in this group.
    pub previous: Option<(SharedGroupState, Option<Timestamp>)>,
}

/// The decision for one member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lane {
    pub state: SharedGroupState,
    /// Replicas the member may have now.
    pub replicas: i32,
    /// Place in line (1 = next) while waiting.
    pub queue_position: Option<i32>,
    /// The higher-priority member that took the lane, while `Preempted`.
    pub preempted_by: Option<String>,
    /// The member the lane is given to.
    pub active_model: Option<String>,
    /// When this member should be looked at again because the answer changes with time.
    pub recheck_after: Option<Duration>,
    /// When the state began (kept from the previous status while it does not change).
    pub since: Timestamp,
}

/// Decide the lane of every member (same order as `members`).
pub fn arbitrate(members: &[Member], now: Timestamp, grace: Duration) -> Vec<Lane> {
    let order = |m: &Member| {
        (
            Reverse(m.priority),
            Reverse(m.running > 0),
            Reverse(matches!(m.previous, Some((SharedGroupState::Active, _)))),
            m.name.clone(),
        )
    };
    let mut line: Vec<&Member> = members.iter().filter(|m| m.wanted > 0).collect();
    line.sort_by_key(|m| order(m));
    let winner = line.first().copied();
    let winner_name = winner.map(|w| w.name.clone());
    members
        .iter()
        .map(|m| {
            let since_of = |state: SharedGroupState| match m.previous {
                Some((s, Some(t))) if s == state => t,
                _ => now,
            };
            let position = line
                .iter()
                .position(|o| o.name == m.name)
                .and_then(|i| i32::try_from(i.saturating_add(1)).ok());
            let mut lane = Lane {
                state: SharedGroupState::Idle,
                replicas: 0,
                queue_position: None,
                preempted_by: None,
                active_model: winner_name.clone(),
                recheck_after: None,
                since: now,
            };
            if Some(m.name.as_str()) == winner_name.as_deref() {
                let others_running = members.iter().any(|o| o.name != m.name && o.running > 0);
                if others_running {
                    lane.state = SharedGroupState::Queued;
                    lane.queue_position = Some(1);
                    lane.recheck_after = Some(HANDOVER_POLL);
                } else {
                    lane.state = SharedGroupState::Active;
                    lane.replicas = m.wanted;
                }
            } else if m.wanted > 0 {
                let w = winner.unwrap_or(m); // a member that wants the lane means there is a winner
                let held = m.running > 0
                    || matches!(
                        m.previous,
                        Some((SharedGroupState::Active | SharedGroupState::Preempted, _))
                    );
                if held && w.priority > m.priority {
                    lane.state = SharedGroupState::Preempted;
                    lane.preempted_by = Some(w.name.clone());
                } else {
                    lane.state = SharedGroupState::Queued;
                }
                // The winner is first in line; the others follow it.
                lane.queue_position = position;
                if m.running > 0 && lane.state == SharedGroupState::Preempted {
                    let began = since_of(SharedGroupState::Preempted);
                    let elapsed =
                        Duration::try_from(now.duration_since(began)).unwrap_or(Duration::ZERO);
                    if m.busy && elapsed < grace {
                        lane.replicas = m.running.min(m.wanted);
                        lane.recheck_after = Some(grace.saturating_sub(elapsed));
                    }
                }
            }
            lane.since = since_of(lane.state);
            lane
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use SharedGroupState::*;

    const NOW: i64 = 1_800_000_000;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap_or_else(|e| panic!("{e}"))
    }

    /// (name, priority, wanted, running, busy, previous state, previous since seconds ago)
    type In<'a> = (&'a str, i32, i32, i32, bool, Option<SharedGroupState>, i64);
    /// (state, replicas, queue position, preempted by, recheck seconds)
    type Out<'a> = (
        SharedGroupState,
        i32,
        Option<i32>,
        Option<&'a str>,
        Option<u64>,
    );

    fn members(ins: &[In]) -> Vec<Member> {
        ins.iter()
            .map(|(n, p, w, r, b, prev, ago)| Member {
                name: n.to_string(),
                priority: *p,
                wanted: *w,
                running: *r,
                busy: *b,
                previous: prev.map(|s| (s, Some(ts(NOW - ago)))),
            })
            .collect()
    }

    #[test]
    fn arbitration_table() {
        let grace = Duration::from_secs(30);
        // A warm primary (250) and a scale-to-zero canary (255).
        let cases: Vec<(&str, Vec<In>, Vec<Out>)> = vec![
            (
                "primary alone holds the lane",
                vec![
                    ("primary", 250, 1, 1, false, Some(Active), 100),
                    ("canary", 255, 0, 0, false, Some(Idle), 100),
                ],
                vec![(Active, 1, None, None, None), (Idle, 0, None, None, None)],
            ),
            (
                "first start: nothing runs yet, the primary takes the lane",
                vec![
                    ("primary", 250, 1, 0, false, None, 0),
                    ("canary", 255, 0, 0, false, None, 0),
                ],
                vec![(Active, 1, None, None, None), (Idle, 0, None, None, None)],
            ),
            (
                "canary demand: the idle primary is preempted at once, the canary waits for it",
                vec![
                    ("primary", 250, 1, 1, false, Some(Active), 100),
                    ("canary", 255, 1, 0, false, Some(Idle), 100),
                ],
                vec![
                    (Preempted, 0, Some(2), Some("canary"), None),
                    (Queued, 0, Some(1), None, Some(5)),
                ],
            ),
            (
                "a busy primary drains within the grace period",
                vec![
                    ("primary", 250, 1, 1, true, Some(Preempted), 10),
                    ("canary", 255, 1, 0, false, Some(Queued), 10),
                ],
                vec![
                    (Preempted, 1, Some(2), Some("canary"), Some(20)),
                    (Queued, 0, Some(1), None, Some(5)),
                ],
            ),
            (
                "the grace period ends even while busy",
                vec![
                    ("primary", 250, 1, 1, true, Some(Preempted), 30),
                    ("canary", 255, 1, 0, false, Some(Queued), 30),
                ],
                vec![
                    (Preempted, 0, Some(2), Some("canary"), None),
                    (Queued, 0, Some(1), None, Some(5)),
                ],
            ),
            (
                "the primary's pods are gone: the canary runs",
                vec![
                    ("primary", 250, 1, 0, false, Some(Preempted), 40),
                    ("canary", 255, 1, 0, false, Some(Queued), 40),
                ],
                vec![
                    (Preempted, 0, Some(2), Some("canary"), None),
                    (Active, 1, None, None, None),
                ],
            ),
            (
                "the canary idles out: it goes to zero, the primary waits for its pods",
                vec![
                    ("primary", 250, 1, 0, false, Some(Preempted), 400),
                    ("canary", 255, 0, 1, false, Some(Active), 400),
                ],
                vec![
                    (Queued, 0, Some(1), None, Some(5)),
                    (Idle, 0, None, None, None),
                ],
            ),
            (
                "the canary is gone: the primary is back",
                vec![
                    ("primary", 250, 1, 0, false, Some(Queued), 5),
                    ("canary", 255, 0, 0, false, Some(Idle), 5),
                ],
                vec![(Active, 1, None, None, None), (Idle, 0, None, None, None)],
            ),
            (
                "lower-priority demand queues behind the warm primary",
                vec![
                    ("primary", 250, 1, 1, false, Some(Active), 100),
                    ("batch", 100, 1, 0, false, None, 0),
                ],
                vec![
                    (Active, 1, None, None, None),
                    (Queued, 0, Some(2), None, None),
                ],
            ),
            (
                "equal priority never preempts: the running one keeps the lane",
                vec![
                    ("a", 200, 1, 0, false, None, 0),
                    ("b", 200, 1, 1, false, Some(Active), 100),
                ],
                vec![
                    (Queued, 0, Some(2), None, None),
                    (Active, 1, None, None, None),
                ],
            ),
            (
                "equal priority, nothing running: the last holder, then the name",
                vec![
                    ("a", 200, 1, 0, false, None, 0),
                    ("b", 200, 1, 0, false, Some(Active), 100),
                    ("c", 200, 1, 0, false, None, 0),
                ],
                vec![
                    (Queued, 0, Some(2), None, None),
                    (Active, 1, None, None, None),
                    (Queued, 0, Some(3), None, None),
                ],
            ),
            (
                "three levels: the highest wins, the others wait in priority order",
                vec![
                    ("low", 10, 1, 0, false, None, 0),
                    ("mid", 50, 2, 2, false, Some(Active), 100),
                    ("high", 90, 1, 0, false, None, 0),
                ],
                vec![
                    (Queued, 0, Some(3), None, None),
                    (Preempted, 0, Some(2), Some("high"), None),
                    (Queued, 0, Some(1), None, Some(5)),
                ],
            ),
            (
                "nobody wants the lane",
                vec![
                    ("a", 1, 0, 0, false, Some(Idle), 100),
                    ("b", 2, 0, 1, false, Some(Active), 100),
                ],
                vec![(Idle, 0, None, None, None), (Idle, 0, None, None, None)],
            ),
            (
                "a draining preempted member keeps at most what it wants",
                vec![
                    ("primary", 250, 1, 3, true, Some(Preempted), 0),
                    ("canary", 255, 1, 0, false, None, 0),
                ],
                vec![
                    (Preempted, 1, Some(2), Some("canary"), Some(30)),
                    (Queued, 0, Some(1), None, Some(5)),
                ],
            ),
        ];
        for (what, ins, want) in cases {
            let ms = members(&ins);
            let got = arbitrate(&ms, ts(NOW), grace);
            assert_eq!(got.len(), want.len(), "{what}");
            for ((m, g), w) in ms.iter().zip(&got).zip(&want) {
                let g_short = (
                    g.state,
                    g.replicas,
                    g.queue_position,
                    g.preempted_by.as_deref(),
                    g.recheck_after.map(|d| d.as_secs()),
                );
                assert_eq!(g_short, *w, "{what}: {}", m.name);
            }
            // Invariant: at most one member runs with replicas while another still has pods.
            let granted: Vec<_> = ms
                .iter()
                .zip(&got)
                .filter(|(_, l)| l.state == Active && l.replicas > 0)
                .collect();
            assert!(granted.len() <= 1, "{what}: {granted:?}");
            if let Some((holder, _)) = granted.first() {
                assert!(
                    ms.iter().all(|o| o.name == holder.name || o.running == 0),
                    "{what}: lane granted while another member runs"
                );
            }
        }
    }

    #[test]
    fn transition_time_is_kept_while_the_state_holds() {
        let ms = members(&[
            ("primary", 250, 1, 1, true, Some(Preempted), 12),
            ("canary", 255, 1, 0, false, Some(Idle), 99),
        ]);
        let got = arbitrate(&ms, ts(NOW), Duration::from_secs(30));
        assert_eq!(got[0].since, ts(NOW - 12), "still Preempted: since kept");
        assert_eq!(got[1].since, ts(NOW), "Idle -> Queued: since now");
        assert!(got
            .iter()
            .all(|l| l.active_model.as_deref() == Some("canary")));
    }
}
