//! pprof encoding: label sets, samples, locations, functions and mappings written from the
//! tables, address frames symbolized on the way.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use crate::error::ProfileError;
use crate::pprof::{
    field, len_field_len, varint_field_len, varint_len, EncodeOptions, EncodedProfile, MappingInfo,
    PbWriter, ResolvedFrame, Symbolizer,
};

use super::tables::{check_table_len, hash_function, Function, Location, Tables, NONE};
use super::Profile;

impl Profile {
    /// Encodes as pprof with `time_nanos` = start and `duration_nanos` = `end` - start.
    pub fn encode(
        &self,
        end: SystemTime,
        opts: &EncodeOptions,
        symbolizer: Option<&mut dyn Symbolizer>,
    ) -> Result<EncodedProfile, ProfileError> {
        let mut w = PbWriter::new(opts.compression)?;
        let t = &self.t;
        let mut extras = Extras::build(t, symbolizer)?;
        // Interned before the string table is written: the period type may be a type the
        // profile does not carry.
        let default_type = match self.metadata.default_sample_type {
            Some(ty) => extras.string(t, ty.name())?,
            None => 0,
        };
        let period = match self.metadata.period {
            Some((ty, period)) => Some((
                extras.string(t, ty.name())?,
                extras.string(t, ty.unit())?,
                period,
            )),
            None => None,
        };
        let label_bytes = encode_label_sets(t);

        for &(ty, unit) in &t.preset.types {
            let len = varint_field_len(ty as u64) + varint_field_len(unit as u64);
            w.len_header(field::PROFILE_SAMPLE_TYPE, len);
            w.uint_field(field::VALUE_TYPE_TYPE, ty as u64);
            w.uint_field(field::VALUE_TYPE_UNIT, unit as u64);
        }

        let ids = LocationIds::by_use(t);
        let n = self.types.len();
        for (row, &(stack, labels)) in t.agg.iter().enumerate() {
            let values = &t.agg_values[row * n..row * n + n];
            write_sample(&mut w, t, &ids, &label_bytes, stack, labels, values, None)?;
        }
        let d = &t.dropped;
        for (row, &labels) in d.labels.iter().enumerate() {
            let values = &d.values[row * n..row * n + n];
            write_sample(&mut w, t, &ids, &label_bytes, d.stack, labels, values, None)?;
        }
        for (i, rec) in t.timed.iter().enumerate() {
            let values = &t.timed_values[i * n..i * n + n];
            let ts_label = (t.preset.end_timestamp, rec.ts);
            let (stack, labels) = (rec.stack, rec.labels);
            write_sample(
                &mut w,
                t,
                &ids,
                &label_bytes,
                stack,
                labels,
                values,
                Some(ts_label),
            )?;
        }

        for (i, m) in extras.mappings.iter().enumerate() {
            write_mapping(&mut w, i as u64 + 1, m);
        }
        w.maybe_flush()?;

        for (pos, &i) in ids.order.iter().enumerate() {
            let id = pos as u64 + 1;
            let i = i as usize;
            match t.locations.items[i] {
                Location::Symbol { function, line } => {
                    write_location(&mut w, id, 0, 0, &[(function, line)]);
                }
                Location::Address(a) => {
                    let mapping = extras.mapping_of(i);
                    write_location(&mut w, id, mapping, a, extras.lines_of(i));
                }
            }
            w.maybe_flush()?;
        }

        let own = t.functions.items.iter().map(|f| ExtraFunction {
            name: f.name,
            system_name: 0,
            filename: f.filename,
            start_line: 0,
        });
        for (i, f) in own.chain(extras.functions.iter().copied()).enumerate() {
            write_function(&mut w, i as u64 + 1, f);
            w.maybe_flush()?;
        }

        for i in 0..t.strings.len() {
            w.bytes_field(
                field::PROFILE_STRING_TABLE,
                t.strings.get(i as u32).as_bytes(),
            );
            w.maybe_flush()?;
        }
        for s in &extras.strings {
            w.bytes_field(field::PROFILE_STRING_TABLE, s.as_bytes());
            w.maybe_flush()?;
        }

        let time_nanos = self
            .start
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        // A clock that went backwards gives a zero duration rather than a failed profile.
        let duration = end.duration_since(self.start).unwrap_or(Duration::ZERO);
        w.int_field(field::PROFILE_TIME_NANOS, saturating_nanos(time_nanos));
        w.int_field(field::PROFILE_DURATION_NANOS, saturating_nanos(duration));
        if let Some((ty, unit, period)) = period {
            let len = varint_field_len(ty as u64) + varint_field_len(unit as u64);
            w.len_header(field::PROFILE_PERIOD_TYPE, len);
            w.uint_field(field::VALUE_TYPE_TYPE, ty as u64);
            w.uint_field(field::VALUE_TYPE_UNIT, unit as u64);
            w.int_field(field::PROFILE_PERIOD, period);
        }
        w.uint_field(field::PROFILE_DEFAULT_SAMPLE_TYPE, default_type as u64);

        let bytes = w.finish()?;
        let mut endpoint_counts: Vec<(String, i64)> = t
            .endpoint_counts
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        endpoint_counts.sort();
        Ok(EncodedProfile {
            start: self.start,
            end,
            bytes,
            compression: opts.compression,
            endpoint_counts,
        })
    }
}

/// The addresses of the profile's locations still to symbolize.
fn address_locations(t: &Tables) -> Vec<u64> {
    t.locations
        .items
        .iter()
        .filter_map(|l| match *l {
            Location::Address(a) => Some(a),
            _ => None,
        })
        .collect()
}

impl Profile {
    /// The addresses a symbolizer is asked for when this profile is encoded (unordered).
    pub fn address_locations(&self) -> Vec<u64> {
        address_locations(&self.t)
    }
}

fn saturating_nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

fn label_len(key: u32, str: u32, num: i64) -> usize {
    varint_field_len(key as u64) + varint_field_len(str as u64) + varint_field_len(num as u64)
}

fn push_label(out: &mut Vec<u8>, key: u32, str: u32, num: i64) {
    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    let len = label_len(key, str, num);
    out.push((field::SAMPLE_LABEL << 3) | 2);
    varint(out, len as u64);
    for (f, v) in [
        (field::LABEL_KEY, key as u64),
        (field::LABEL_STR, str as u64),
        (field::LABEL_NUM, num as u64),
    ] {
        if v != 0 {
            out.push(f << 3);
            varint(out, v);
        }
    }
}

/// Encoded `Sample.label` fields of every label set (endpoint label included), back to back.
struct LabelBytes {
    bytes: Vec<u8>,
    spans: Vec<(u32, u32)>,
}

impl LabelBytes {
    fn get(&self, set: u32) -> &[u8] {
        let (off, len) = self.spans[set as usize];
        &self.bytes[off as usize..(off + len) as usize]
    }
}

fn encode_label_sets(t: &Tables) -> LabelBytes {
    let mut out = LabelBytes {
        bytes: Vec::new(),
        spans: Vec::with_capacity(t.label_sets.spans.len()),
    };
    for set in 0..t.label_sets.spans.len() {
        let start = out.bytes.len();
        let mut span_id = None;
        let mut has_endpoint = false;
        for &lid in t.label_sets.get(set as u32) {
            let l = t.labels.items[lid as usize];
            let str = if l.str == NONE { 0 } else { l.str };
            push_label(&mut out.bytes, l.key, str, l.num);
            if l.key == t.preset.local_root_span_id && l.str == NONE {
                span_id = Some(l.num as u64);
            }
            has_endpoint |= l.key == t.preset.trace_endpoint;
        }
        // A sample that already names its endpoint keeps it; never two `trace endpoint` labels.
        if let (Some(span), false) = (span_id, has_endpoint) {
            let ep = t
                .endpoints
                .get(&span)
                .or_else(|| t.late_endpoints.get(&span));
            if let Some(&ep) = ep {
                push_label(&mut out.bytes, t.preset.trace_endpoint, ep, 0);
            }
        }
        out.spans
            .push((start as u32, (out.bytes.len() - start) as u32));
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn write_sample(
    w: &mut PbWriter,
    t: &Tables,
    ids: &LocationIds,
    label_bytes: &LabelBytes,
    stack: u32,
    labels: u32,
    values: &[i64],
    ts_label: Option<(u32, i64)>,
) -> Result<(), ProfileError> {
    let locs = t.stacks.get(stack);
    let labels = label_bytes.get(labels);
    let locs_len: usize = locs.iter().map(|&l| varint_len(ids.id(l) as u64)).sum();
    let values_len: usize = values.iter().map(|&v| varint_len(v as u64)).sum();
    let ts_len = ts_label.map_or(0, |(k, ts)| len_field_len(label_len(k, 0, ts)));
    let mut len = labels.len() + ts_len;
    if !locs.is_empty() {
        len += len_field_len(locs_len);
    }
    if !values.is_empty() {
        len += len_field_len(values_len);
    }
    w.len_header(field::PROFILE_SAMPLE, len);
    if !locs.is_empty() {
        w.len_header(field::SAMPLE_LOCATION_ID, locs_len);
        for &l in locs {
            w.varint(ids.id(l) as u64);
        }
    }
    if !values.is_empty() {
        w.len_header(field::SAMPLE_VALUE, values_len);
        for &v in values {
            w.varint(v as u64);
        }
    }
    w.raw(labels);
    if let Some((k, ts)) = ts_label {
        w.len_header(field::SAMPLE_LABEL, label_len(k, 0, ts));
        w.uint_field(field::LABEL_KEY, k as u64);
        w.int_field(field::LABEL_NUM, ts);
    }
    w.maybe_flush()
}

/// pprof ids of the locations, most used first: ids below 128 take one byte in every sample
/// that names them, which shrinks the samples (the bulk of a profile) noticeably. Locations no
/// sample uses are left out.
struct LocationIds {
    /// Location index -> pprof id (1-based; 0 = unused).
    id_of: Vec<u32>,
    /// pprof id - 1 -> location index.
    order: Vec<u32>,
}

impl LocationIds {
    fn by_use(t: &Tables) -> LocationIds {
        let mut stack_uses = vec![0u64; t.stacks.spans.len()];
        for &(stack, _) in &t.agg {
            stack_uses[stack as usize] += 1;
        }
        for rec in &t.timed {
            stack_uses[rec.stack as usize] += 1;
        }
        if t.dropped.stack != NONE {
            stack_uses[t.dropped.stack as usize] += t.dropped.labels.len() as u64;
        }
        let mut uses = vec![0u64; t.locations.items.len()];
        for (stack, &n) in stack_uses.iter().enumerate() {
            if n > 0 {
                for &l in t.stacks.get(stack as u32) {
                    uses[l as usize] += n;
                }
            }
        }
        let mut order: Vec<u32> = (0..uses.len() as u32)
            .filter(|&l| uses[l as usize] > 0)
            .collect();
        // Stable: equally used locations keep their first-seen order.
        order.sort_by_key(|&l| std::cmp::Reverse(uses[l as usize]));
        let mut id_of = vec![0u32; uses.len()];
        for (pos, &l) in order.iter().enumerate() {
            id_of[l as usize] = pos as u32 + 1;
        }
        LocationIds { id_of, order }
    }

    #[inline]
    fn id(&self, location: u32) -> u32 {
        self.id_of[location as usize]
    }
}

/// A location; `mapping` is its mapping's pprof id (0: none).
fn write_location(w: &mut PbWriter, id: u64, mapping: u64, address: u64, lines: &[(u32, i64)]) {
    let line_len = |&(f, l): &(u32, i64)| -> usize {
        varint_field_len(f as u64 + 1) + varint_field_len(l as u64)
    };
    let len = varint_field_len(id)
        + varint_field_len(mapping)
        + varint_field_len(address)
        + lines
            .iter()
            .map(|l| len_field_len(line_len(l)))
            .sum::<usize>();
    w.len_header(field::PROFILE_LOCATION, len);
    w.uint_field(field::LOCATION_ID, id);
    w.uint_field(field::LOCATION_MAPPING_ID, mapping);
    w.uint_field(field::LOCATION_ADDRESS, address);
    for l in lines {
        w.len_header(field::LOCATION_LINE, line_len(l));
        w.uint_field(field::LINE_FUNCTION_ID, l.0 as u64 + 1);
        w.int_field(field::LINE_LINE, l.1);
    }
}

fn write_function(w: &mut PbWriter, id: u64, f: ExtraFunction) {
    let len = varint_field_len(id)
        + varint_field_len(f.name as u64)
        + varint_field_len(f.system_name as u64)
        + varint_field_len(f.filename as u64)
        + varint_field_len(f.start_line as u64);
    w.len_header(field::PROFILE_FUNCTION, len);
    w.uint_field(field::FUNCTION_ID, id);
    w.uint_field(field::FUNCTION_NAME, f.name as u64);
    w.uint_field(field::FUNCTION_SYSTEM_NAME, f.system_name as u64);
    w.uint_field(field::FUNCTION_FILENAME, f.filename as u64);
    w.int_field(field::FUNCTION_START_LINE, f.start_line);
}

fn write_mapping(w: &mut PbWriter, id: u64, m: &MappingRec) {
    let flags = [
        (field::MAPPING_HAS_FUNCTIONS, m.info.has_functions),
        (field::MAPPING_HAS_FILENAMES, m.info.has_filenames),
        (field::MAPPING_HAS_LINE_NUMBERS, m.info.has_line_numbers),
        (field::MAPPING_HAS_INLINE_FRAMES, m.info.has_inline_frames),
    ];
    let len = varint_field_len(id)
        + varint_field_len(m.info.memory_start)
        + varint_field_len(m.info.memory_limit)
        + varint_field_len(m.info.file_offset)
        + varint_field_len(m.filename as u64)
        + varint_field_len(m.build_id as u64)
        + flags
            .iter()
            .map(|&(_, b)| varint_field_len(b as u64))
            .sum::<usize>();
    w.len_header(field::PROFILE_MAPPING, len);
    w.uint_field(field::MAPPING_ID, id);
    w.uint_field(field::MAPPING_MEMORY_START, m.info.memory_start);
    w.uint_field(field::MAPPING_MEMORY_LIMIT, m.info.memory_limit);
    w.uint_field(field::MAPPING_FILE_OFFSET, m.info.file_offset);
    w.uint_field(field::MAPPING_FILENAME, m.filename as u64);
    w.uint_field(field::MAPPING_BUILD_ID, m.build_id as u64);
    for (f, b) in flags {
        w.uint_field(f, b as u64);
    }
}

/// A function as written: the profile's own carry a name and a file only.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct ExtraFunction {
    name: u32,
    system_name: u32,
    filename: u32,
    start_line: i64,
}

/// A mapping as written, its strings interned.
struct MappingRec {
    info: MappingInfo,
    filename: u32,
    build_id: u32,
}

/// Functions, strings and mappings that only symbolization at encode time brings in. Their ids
/// continue after the profile's own tables.
#[derive(Default)]
struct Extras {
    strings: Vec<String>,
    string_ids: HashMap<String, u32, foldhash::fast::RandomState>,
    functions: Vec<ExtraFunction>,
    function_ids: HashMap<ExtraFunction, u32, foldhash::fast::RandomState>,
    /// (function id, line) of symbolized addresses, innermost first.
    lines: Vec<(u32, i64)>,
    /// Per location: span in `lines` (empty for symbol locations and unknown addresses).
    spans: Vec<(u32, u32)>,
    /// The mappings locations fall in, by memory start (the main program, loaded lowest in
    /// the usual layouts, comes first, where viewers look for it).
    mappings: Vec<MappingRec>,
    /// Per location: index in `mappings` + 1 (0: none).
    location_mappings: Vec<u32>,
}

impl Extras {
    fn build(t: &Tables, symbolizer: Option<&mut dyn Symbolizer>) -> Result<Extras, ProfileError> {
        let mut x = Extras::default();
        let Some(sym) = symbolizer else {
            return Ok(x);
        };
        let addresses = address_locations(t);
        sym.prepare(&addresses);
        drop(addresses);
        let mut out: Vec<ResolvedFrame> = Vec::new();
        x.spans = vec![(0, 0); t.locations.items.len()];
        x.location_mappings = vec![0; t.locations.items.len()];
        // (memory start, limit, file offset) -> index in `mappings` + 1.
        let mut mapping_ids: HashMap<(u64, u64, u64), u32, foldhash::fast::RandomState> =
            HashMap::default();
        for (i, loc) in t.locations.items.iter().enumerate() {
            let Location::Address(addr) = *loc else {
                continue;
            };
            out.clear();
            sym.symbolize(addr, &mut out);
            let start = x.lines.len();
            for f in &out {
                let function = ExtraFunction {
                    name: x.string(t, &f.name)?,
                    system_name: x.string(t, &f.system_name)?,
                    filename: x.string(t, &f.filename)?,
                    start_line: f.start_line,
                };
                let function = x.function(t, function)?;
                x.lines.push((function, f.line));
            }
            x.spans[i] = (start as u32, (x.lines.len() - start) as u32);
            if let Some(m) = sym.mapping(addr) {
                let key = (m.memory_start, m.memory_limit, m.file_offset);
                let id = match mapping_ids.get(&key) {
                    Some(&id) => id,
                    None => {
                        let m = m.clone();
                        let rec = MappingRec {
                            filename: x.string(t, &m.filename)?,
                            build_id: x.string(t, &m.build_id)?,
                            info: m,
                        };
                        x.mappings.push(rec);
                        mapping_ids.insert(key, x.mappings.len() as u32);
                        x.mappings.len() as u32
                    }
                };
                x.location_mappings[i] = id;
            }
        }
        if x.mappings.len() > 1 {
            let mut order: Vec<u32> = (0..x.mappings.len() as u32).collect();
            order.sort_by_key(|&k| x.mappings[k as usize].info.memory_start);
            let mut new_id = vec![0u32; order.len() + 1];
            for (pos, &k) in order.iter().enumerate() {
                new_id[k as usize + 1] = pos as u32 + 1;
            }
            for m in &mut x.location_mappings {
                *m = new_id[*m as usize];
            }
            // Stable, by the same key: the same permutation as `order`.
            x.mappings.sort_by_key(|m| m.info.memory_start);
        }
        Ok(x)
    }

    fn string(&mut self, t: &Tables, s: &str) -> Result<u32, ProfileError> {
        if let Some(id) = t.strings.find(s) {
            return Ok(id);
        }
        if let Some(&id) = self.string_ids.get(s) {
            return Ok(id);
        }
        let next = t.strings.len() + self.strings.len();
        check_table_len(next, "string")?;
        self.strings.push(s.to_owned());
        self.string_ids.insert(s.to_owned(), next as u32);
        Ok(next as u32)
    }

    fn function(&mut self, t: &Tables, f: ExtraFunction) -> Result<u32, ProfileError> {
        if f.system_name == 0 && f.start_line == 0 {
            // What the profile's own functions carry: the same function when it names one.
            let own = Function {
                name: f.name,
                filename: f.filename,
            };
            if let Some(id) = t.functions.find(own, hash_function(own)) {
                return Ok(id);
            }
        }
        if let Some(&id) = self.function_ids.get(&f) {
            return Ok(id);
        }
        let next = t.functions.items.len() + self.functions.len();
        check_table_len(next, "function")?;
        self.functions.push(f);
        self.function_ids.insert(f, next as u32);
        Ok(next as u32)
    }

    /// The pprof id of the mapping of location `location` (0: none).
    fn mapping_of(&self, location: usize) -> u64 {
        self.location_mappings
            .get(location)
            .map_or(0, |&m| m as u64)
    }

    fn lines_of(&self, location: usize) -> &[(u32, i64)] {
        match self.spans.get(location) {
            Some(&(off, len)) => &self.lines[off as usize..(off + len) as usize],
            None => &[],
        }
    }
}
