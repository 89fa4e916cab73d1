//! Sample filters for `top`, `flamegraph` and `diff`: `--focus`/`--ignore` by function name,
//! `--tag` by label.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

use clap::Args;
use ferroprof_pprof::{Profile, Sample};
use regex::Regex;

use crate::report::{CliError, Frames};

#[derive(Args, Clone, Debug, Default)]
#[command(next_help_heading = "Filters")]
pub struct FilterArgs {
    /// Keep only samples whose stack has a function matching REGEX (searched anywhere in the
    /// full name; anchor with ^ and $).
    #[arg(long, value_name = "REGEX", value_parser = parse_regex)]
    pub focus: Option<Regex>,
    /// Drop samples whose stack has a function matching REGEX.
    #[arg(long, value_name = "REGEX", value_parser = parse_regex)]
    pub ignore: Option<Regex>,
    /// Keep only samples with the label KEY=VALUE, e.g. --tag 'thread name=tokio-rt-worker'.
    /// String labels compare as text, numeric labels as numbers. Repeat to require several.
    #[arg(long = "tag", value_name = "KEY=VALUE", value_parser = parse_tag)]
    pub tags: Vec<Tag>,
}

/// One `--tag KEY=VALUE`.
#[derive(Clone, Debug)]
pub struct Tag {
    key: String,
    value: String,
    /// `value` as a number, for numeric labels.
    num: Option<i64>,
}

fn parse_regex(s: &str) -> Result<Regex, String> {
    Regex::new(s).map_err(|e| format!("not a valid regular expression: {e}"))
}

fn parse_tag(s: &str) -> Result<Tag, String> {
    const EXAMPLE: &str = "expected KEY=VALUE, e.g. 'thread name=tokio-rt-worker'";
    // Split at the first '=': keys are names, values may hold anything.
    let Some((key, value)) = s.split_once('=') else {
        return Err(format!("no '=' in {s:?}; {EXAMPLE}"));
    };
    if key.is_empty() {
        return Err(format!("no label name before '=' in {s:?}; {EXAMPLE}"));
    }
    if value.is_empty() {
        return Err(format!("no value after '=' in {s:?}; {EXAMPLE}"));
    }
    Ok(Tag {
        key: key.to_owned(),
        value: value.to_owned(),
        num: value.trim().parse().ok(),
    })
}

impl Tag {
    fn matches(&self, p: &Profile, s: &Sample) -> bool {
        s.label.iter().any(|l| {
            p.str(l.key) == self.key
                && if l.str != 0 {
                    p.str(l.str) == self.value
                } else {
                    self.num == Some(l.num)
                }
        })
    }
}

/// What a filter did to one profile.
pub struct Kept {
    pub kept: usize,
    pub of: usize,
    /// Why a tag matched nothing, when one did: the values its key has.
    pub hint: Option<String>,
}

impl Kept {
    /// "kept 3 of 9 samples" and the hint, if any.
    pub fn summary(&self) -> String {
        let mut s = format!("kept {} of {} samples", self.kept, self.of);
        if let Some(h) = &self.hint {
            let _ = write!(s, "; {h}");
        }
        s
    }
}

impl FilterArgs {
    pub fn is_active(&self) -> bool {
        self.focus.is_some() || self.ignore.is_some() || !self.tags.is_empty()
    }

    /// The filters as given on the command line, for titles and messages.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(r) = &self.focus {
            parts.push(format!("--focus '{}'", r.as_str()));
        }
        if let Some(r) = &self.ignore {
            parts.push(format!("--ignore '{}'", r.as_str()));
        }
        for t in &self.tags {
            parts.push(format!("--tag '{}={}'", t.key, t.value));
        }
        parts.join(" ")
    }

    /// Removes the samples the filters reject from `p`; `None` when there are no filters. A
    /// tag whose label no sample of the file has is an error (most likely a misspelt key),
    /// naming the labels the file has.
    pub fn apply(&self, p: &mut Profile, path: &Path) -> anyhow::Result<Option<Kept>> {
        if !self.is_active() {
            return Ok(None);
        }
        for t in &self.tags {
            let has_key = p
                .sample
                .iter()
                .any(|s| s.label.iter().any(|l| p.str(l.key) == t.key));
            if !has_key {
                let keys: BTreeSet<&str> = p
                    .sample
                    .iter()
                    .flat_map(|s| s.label.iter().map(|l| p.str(l.key)))
                    .collect();
                let keys: Vec<&str> = keys.into_iter().collect();
                let has = if keys.is_empty() {
                    "its samples have no labels".to_owned()
                } else {
                    format!("its labels are: {}", keys.join(", "))
                };
                return Err(CliError(format!(
                    "{}: no sample has a label {:?} (--tag '{}={}'); {has}",
                    path.display(),
                    t.key,
                    t.key,
                    t.value
                ))
                .into());
            }
        }
        let keep = self.keep(p);
        let of = p.sample.len();
        let kept = keep.iter().filter(|&&k| k).count();
        let hint = if kept == 0 { self.tag_hint(p) } else { None };
        // `retain` visits the samples once each, in order.
        let mut keep = keep.into_iter();
        p.sample.retain(|_| keep.next().unwrap_or(true));
        Ok(Some(Kept { kept, of, hint }))
    }

    /// Whether each sample passes every filter. Regexes run once per distinct name, not per
    /// frame.
    fn keep(&self, p: &Profile) -> Vec<bool> {
        let tags_match = |s: &Sample| self.tags.iter().all(|t| t.matches(p, s));
        if self.focus.is_none() && self.ignore.is_none() {
            return p.sample.iter().map(tags_match).collect();
        }
        let frames = Frames::new(p);
        let matching = |r: &Option<Regex>| {
            r.as_ref().map(|r| {
                frames
                    .names
                    .iter()
                    .map(|n| r.is_match(n))
                    .collect::<Vec<_>>()
            })
        };
        let (focus, ignore) = (matching(&self.focus), matching(&self.ignore));
        let mut stack = Vec::new();
        p.sample
            .iter()
            .map(|s| {
                if !tags_match(s) {
                    return false;
                }
                frames.stack(s, &mut stack);
                let any = |m: &Vec<bool>| stack.iter().any(|&f| m[f]);
                focus.as_ref().is_none_or(any) && !ignore.as_ref().is_some_and(any)
            })
            .collect()
    }

    /// For the first tag that alone matches no sample: the values its key has (a few).
    fn tag_hint(&self, p: &Profile) -> Option<String> {
        const SHOWN: usize = 8;
        let t = self
            .tags
            .iter()
            .find(|t| !p.sample.iter().any(|s| t.matches(p, s)))?;
        let mut values = BTreeSet::new();
        for s in &p.sample {
            for l in s.label.iter().filter(|l| p.str(l.key) == t.key) {
                values.insert(if l.str != 0 {
                    format!("{:?}", p.str(l.str))
                } else {
                    l.num.to_string()
                });
            }
        }
        let n = values.len();
        let mut shown: Vec<String> = values.into_iter().take(SHOWN).collect();
        if n > SHOWN {
            shown.push(format!("… ({n} in all)"));
        }
        Some(format!(
            "no sample has {}={}; its values include {}",
            t.key,
            t.value,
            shown.join(", ")
        ))
    }
}
