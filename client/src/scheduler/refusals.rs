//! One worker's refusal is that worker's problem. A worker that refuses this rank's token, or
//! refuses or fails a batch (`Unauthorized`, `BadRequest`, `Failed`), is not asked for that
//! batch again and the batch goes to another; the trainer gets the error only when every
//! worker listed has refused it or cannot be reached, naming each one's reason. A batch that
//! two workers fail (`Failed`) is the data's fault, not theirs: every worker builds the same
//! batch, so a sample failing under `on_error: fail` ends the job after one more worker has
//! confirmed it, and one broken worker cannot.

use super::*;

/// Why a worker refused or failed one batch.
pub(super) struct Refusal {
    code: ErrorCode,
    message: String,
}

/// Workers that must fail a batch (`Failed`) before it is the data's fault.
const DATA_FAILURE_WITNESSES: usize = 2;
/// Workers an error names one by one; the rest are counted.
const NAMED: usize = 8;

impl Scheduler {
    /// What `addr` said refusing this rank's token, while that is its problem (until it
    /// accepts the token: comes up, or refuses for another reason).
    pub(super) fn token_refusal(&self, addr: &str) -> Option<&str> {
        match self.problems.get(addr)? {
            Error::Unauthorized { reason, .. } => Some(reason),
            _ => None,
        }
    }

    /// `addr` refused this rank's token. Only when every worker listed has, retrying cannot
    /// help: the trainer is told at once.
    pub(super) fn token_refused(&mut self, addr: String, reason: String) {
        let refusal = Error::Unauthorized {
            worker: addr.clone(),
            reason,
        };
        self.problems.insert(addr, refusal);
        let each: Option<Vec<(&str, &str)>> = self
            .wanted
            .iter()
            .map(|a| self.token_refusal(a).map(|r| (a.as_str(), r)))
            .collect();
        let Some((worker, reason)) = each.filter(|e| !e.is_empty()).map(name_each) else {
            return;
        };
        let refusal = Error::Unauthorized { worker, reason };
        self.fail_identity(refusal.clone());
        self.fail_trainer(refusal);
    }

    /// `addr` refused or failed `position`: never asked for it again; the data's fault once
    /// enough workers failed it, else asked elsewhere (and given up by
    /// [`Scheduler::give_up_refused_everywhere`] when no one is left).
    pub(super) fn batch_refused(
        &mut self,
        position: u64,
        request_id: u64,
        addr: &str,
        e: ErrorFrame,
    ) {
        self.metrics.retry(match e.code {
            ErrorCode::Failed => RetryReason::Failed,
            _ => RetryReason::Refused,
        });
        let Some(p) = self.drop_attempt(position, request_id, addr) else {
            return;
        };
        let refusal = Refusal {
            code: e.code,
            message: e.message,
        };
        p.refused_by.insert(addr.to_string(), refusal);
        let witnesses = p.refused_by.values();
        if witnesses.filter(|r| r.code == ErrorCode::Failed).count() >= DATA_FAILURE_WITNESSES {
            self.give_up_refused(position);
        }
    }

    /// Positions that every worker listed has refused, or cannot take (it refused the
    /// token, or its connection failed and has not come back): the trainer gets their error.
    pub(super) fn give_up_refused_everywhere(&mut self) {
        let stranded: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.attempts.is_empty() && !p.refused_by.is_empty())
            .filter(|(_, p)| {
                let out = |a: &String| p.refused_by.contains_key(a) || self.out_of_reach(a);
                self.wanted.iter().all(out)
            })
            .map(|(pos, _)| *pos)
            .collect();
        for position in stranded {
            self.give_up_refused(position);
        }
    }

    /// `addr` refused the token, or its last connection failed, and it serves nothing now.
    fn out_of_reach(&self, addr: &str) -> bool {
        let serving = || {
            self.by_addr
                .get(addr)
                .is_some_and(|id| self.links[id].up && !self.links[id].draining)
        };
        self.problems.contains_key(addr) && !serving()
    }

    /// The trainer gets `position`'s error, naming each worker that refused or failed it and
    /// each other that could not be asked, with its reason.
    fn give_up_refused(&mut self, position: u64) {
        let Some(p) = self.pending.get(&position) else {
            return;
        };
        let attempts = p.attempts.clone();
        let mut each: Vec<(String, String)> = p
            .refused_by
            .iter()
            .map(|(a, r)| (a.clone(), r.message.clone()))
            .collect();
        for a in self
            .wanted
            .iter()
            .filter(|a| !p.refused_by.contains_key(*a))
        {
            if let Some(why) = self.token_refusal(a) {
                each.push((a.clone(), why.to_string()));
            } else if let Some(problem) = self.problems.get(a).filter(|_| self.out_of_reach(a)) {
                each.push((a.clone(), problem.to_string()));
            }
        }
        for id in attempts {
            self.abandon(id);
        }
        let (workers, reason) = name_each(each.iter().map(|(a, r)| (a.as_str(), r.as_str())));
        self.give_up(position, &workers, &reason);
    }
}

/// Workers and their reasons for an error message: the workers named (up to [`NAMED`], the
/// rest counted), and the reason once if they all gave the same, else each with its worker.
fn name_each<'a>(each: impl IntoIterator<Item = (&'a str, &'a str)>) -> (String, String) {
    let each: Vec<(&str, &str)> = each.into_iter().collect();
    let more = match each.len() {
        n if n > NAMED => format!(" and {} more", n - NAMED),
        _ => String::new(),
    };
    let named = each.iter().take(NAMED);
    let workers = named
        .clone()
        .map(|(a, _)| *a)
        .collect::<Vec<_>>()
        .join(", ")
        + &more;
    let first = each.first().map_or("", |(_, r)| *r);
    let reason = match each.iter().all(|(_, r)| *r == first) {
        true => first.to_string(),
        false => {
            let each: Vec<String> = named.map(|(a, r)| format!("{a}: {r}")).collect();
            each.join("; ") + &more
        }
    };
    (workers, reason)
}

#[cfg(test)]
mod tests {
    use super::name_each;

    #[test]
    fn workers_are_named_with_their_reasons_and_many_are_counted() {
        assert_eq!(
            name_each([("a", "corrupt")]),
            ("a".to_string(), "corrupt".to_string())
        );
        assert_eq!(
            name_each([("a", "wrong token"), ("b", "wrong token")]),
            ("a, b".to_string(), "wrong token".to_string())
        );
        assert_eq!(
            name_each([("a", "x"), ("b", "y")]).1,
            "a: x; b: y".to_string()
        );
        let many: Vec<(String, String)> = (0..10).map(|i| (format!("w{i}"), "no".into())).collect();
        let (workers, reason) = name_each(many.iter().map(|(a, r)| (a.as_str(), r.as_str())));
        assert_eq!(workers, "w0, w1, w2, w3, w4, w5, w6, w7 and 2 more");
        assert_eq!(reason, "no");
    }
}
