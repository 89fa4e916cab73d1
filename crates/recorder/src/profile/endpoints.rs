//! Endpoints: the trace endpoint named for a local root span id (applied as a label when
//! encoding, also to samples recorded before), and the bounded per-endpoint counts.

use crate::error::ProfileError;

use super::tables::{check_table_len, hash_label, LabelRec, NONE};
use super::Profile;

/// Label key whose numeric value links samples to an endpoint.
pub const LOCAL_ROOT_SPAN_ID_LABEL: &str = "local root span id";
/// Label key added at encoding for samples whose span has an endpoint.
pub const TRACE_ENDPOINT_LABEL: &str = "trace endpoint";
/// Distinct endpoint names a profile keeps: a name beyond them is counted (and labels its
/// samples) as [`OTHER_ENDPOINTS`], so a caller naming endpoints by raw path cannot grow a profile
/// without bound.
pub const MAX_ENDPOINT_NAMES: usize = 4096;
/// What endpoints past [`MAX_ENDPOINT_NAMES`] are counted as.
pub const OTHER_ENDPOINTS: &str = "[other endpoints]";
/// Endpoints kept for roots no sample of the profile carried yet when named
/// ([`Profile::set_endpoint`]): the most recent ones, for samples recorded after their request
/// ended (a sampler that waited for a CPU records a tick's captures late). About 2 MiB at most;
/// 65,536 requests are over 3 s of a service serving 20,000 a second.
pub const LATE_ENDPOINTS: usize = 65_536;

impl Profile {
    /// Associates an endpoint with a local root span id (last call wins) and counts it.
    ///
    /// The mapping is kept for a root that samples of this profile carry already, and for the
    /// last [`LATE_ENDPOINTS`] others (samples of a request may be recorded shortly after it
    /// ended): a service naming every request keeps memory in proportion to the requests it
    /// sampled, not to all it served.
    pub fn set_endpoint(
        &mut self,
        local_root_span_id: u64,
        endpoint: &str,
    ) -> Result<(), ProfileError> {
        check_table_len(self.t.strings.len(), "string")?;
        let endpoint = self.bounded_endpoint(endpoint);
        let id = self.t.strings.intern(endpoint);
        let t = &mut self.t;
        let rec = LabelRec {
            key: t.preset.local_root_span_id,
            str: NONE,
            num: local_root_span_id as i64,
        };
        if t.labels.find(rec, hash_label(rec)).is_some() {
            t.endpoints.insert(local_root_span_id, id);
        } else if t.late_endpoints.insert(local_root_span_id, id).is_none() {
            t.late_order.push_back(local_root_span_id);
            if t.late_order.len() > LATE_ENDPOINTS {
                if let Some(old) = t.late_order.pop_front() {
                    t.late_endpoints.remove(&old);
                }
            }
        }
        self.add_endpoint_count(endpoint, 1)
    }

    /// `endpoint`, or [`OTHER_ENDPOINTS`] when the profile holds [`MAX_ENDPOINT_NAMES`] others.
    fn bounded_endpoint<'e>(&self, endpoint: &'e str) -> &'e str {
        let counts = &self.t.endpoint_counts;
        if counts.len() >= MAX_ENDPOINT_NAMES && !counts.contains_key(endpoint) {
            OTHER_ENDPOINTS
        } else {
            endpoint
        }
    }

    /// Adds `value` to the endpoint's count (reported in `EncodedProfile::endpoint_counts`);
    /// past [`MAX_ENDPOINT_NAMES`] names, to [`OTHER_ENDPOINTS`].
    pub fn add_endpoint_count(&mut self, endpoint: &str, value: i64) -> Result<(), ProfileError> {
        let endpoint = self.bounded_endpoint(endpoint);
        match self.t.endpoint_counts.get_mut(endpoint) {
            Some(c) => *c = c.saturating_add(value),
            None => {
                self.t.endpoint_counts.insert(endpoint.to_owned(), value);
            }
        }
        Ok(())
    }
}
