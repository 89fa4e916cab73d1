//! `tracing` integration (cargo feature `tracing`): [`FerroprofLayer`] keeps each thread's label
//! context (see [`crate::labels`]) in step with the spans it enters, so CPU, wall and
//! allocation samples carry the `span id` and `local root span id` of the span active on the
//! thread, and records each root span's endpoint so its samples carry `trace endpoint`.
//!
//! ```
//! use tracing_subscriber::layer::SubscriberExt;
//!
//! let subscriber = tracing_subscriber::registry()
//!     .with(ferroprof::tracing::FerroprofLayer::new()); // endpoint from `http.route`
//! # drop(subscriber);
//! ```
//!
//! * **Span ids.** `span id` is the span's tracing [`Id`] (as `u64`); `local root span id` is the
//!   id of its outermost ancestor (the span itself when it has no parent).
//! * **Threads.** Enter and exit happen on the thread that polls or runs the span (a tokio task
//!   instrumented with `.instrument(span)` is entered on whichever worker polls it), so the
//!   context follows the span from worker to worker. Each thread keeps a stack of the contexts
//!   its enters replaced; an exit restores the one before (exits out of order are handled).
//! * **Endpoints.** A root span's endpoint is its `http.route` field (the field is configurable,
//!   [`FerroprofLayer::endpoint_field`]; a value recorded later with `Span::record` counts),
//!   else its name. It is recorded once, when the root span closes, through
//!   [`crate::labels::record_endpoint`]: the profile collecting then labels every sample of that
//!   trace with `trace endpoint` and counts one request for the endpoint (Datadog's
//!   `endpoint_counts`).
//! * **Cost and memory.** Enter and exit take no lock and, once the thread has its label slot,
//!   allocate nothing: a span's root is found when the span is created and kept in a fixed,
//!   direct-mapped table of 4,096 entries (an entry another span took over is found again in
//!   the registry), so an enter is a table read and one publish into the thread's slot, an exit
//!   one publish. Per-span data (a root span's endpoint) lives in the span's extensions and
//!   goes with the span; the per-thread stack is as deep as the spans entered at once (capped at
//!   [`MAX_DEPTH`]). Nothing grows with the number of distinct spans. A root span's close
//!   records its endpoint into the running profile (the recorder's short locks, as a sample).
//!
//! * **OpenTelemetry** (cargo feature `opentelemetry`). When `tracing-opentelemetry`'s layer makes
//!   a span an OpenTelemetry span, `span id` and `local root span id` are its OTel span id and
//!   the OTel span id of its local root (as `u64`, big-endian bytes), so a profile links to the
//!   trace in the tracing backend (Datadog reads the two numeric labels; the Pyroscope exporter
//!   writes `span_id` in hex from the same value). Add this layer *after* the OpenTelemetry
//!   layer (`registry().with(otel_layer).with(FerroprofLayer::new())`): it reads the OTel ids
//!   when a span is created, once the OpenTelemetry layer has made them; a span without them
//!   keeps its tracing ids.

use std::borrow::Cow;
use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing_core::field::{Field, Visit};
use tracing_core::span::{Attributes, Id, Record};
use tracing_core::Subscriber;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

use crate::labels;

/// Spans a thread can have entered at once with their context set; deeper enters leave the
/// context as it is (the stack never grows past this, even with enters that are never exited).
pub const MAX_DEPTH: usize = 256;

/// The default field a root span's endpoint is read from.
pub const DEFAULT_ENDPOINT_FIELD: &str = "http.route";

/// A [`Layer`] that labels samples with the tracing span active on each thread and names each
/// trace's endpoint (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct FerroprofLayer {
    endpoint_field: Cow<'static, str>,
    /// The dispatcher this layer is part of, to ask `tracing-opentelemetry` for a span's
    /// context.
    #[cfg(feature = "opentelemetry")]
    dispatch: std::sync::Arc<std::sync::OnceLock<tracing_core::dispatcher::WeakDispatch>>,
}

impl Default for FerroprofLayer {
    fn default() -> Self {
        FerroprofLayer::new()
    }
}

impl FerroprofLayer {
    /// A layer taking endpoints from the root span's `http.route` field, else its name.
    pub fn new() -> Self {
        FerroprofLayer {
            endpoint_field: Cow::Borrowed(DEFAULT_ENDPOINT_FIELD),
            #[cfg(feature = "opentelemetry")]
            dispatch: Default::default(),
        }
    }

    /// Reads endpoints from the root span's field `name` instead of `http.route` (the root
    /// span's name stays the fallback).
    pub fn endpoint_field(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.endpoint_field = name.into();
        self
    }
}

/// What a root span keeps in its extensions: its endpoint.
struct RootEndpoint(Cow<'static, str>);

/// The ids a span's samples carry (its tracing ids, or its OpenTelemetry ones), kept in its
/// extensions for when its [`ROOTS`] entry was taken over.
#[derive(Clone, Copy)]
struct SpanIds {
    span: u64,
    root: u64,
}

/// Finds the endpoint field among a span's values.
struct EndpointVisitor<'a> {
    field: &'a str,
    found: Option<String>,
}

impl Visit for EndpointVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == self.field {
            self.found = Some(value.to_owned());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == self.field {
            self.found = Some(format!("{value:?}"));
        }
    }
}

/// One enter a thread made: the span entered and the span words it replaced.
#[derive(Clone, Copy)]
struct Entered {
    id: u64,
    prev: (u64, u64),
}

thread_local! {
    static STACK: RefCell<Vec<Entered>> = const { RefCell::new(Vec::new()) };
}

/// Entries of [`ROOTS`].
const ROOT_CACHE: usize = 4096;

/// Span id -> local root span id, written when a span is created, so entering it needs no
/// registry lookup (two lookups, each a pair of atomic read-modify-writes on the span's slot, were
/// most of an enter's cost). Direct-mapped by id: a later span may take an entry over; an entry
/// is three words written without a lock, and a reader trusts it only when its check word
/// matches its id and root (a torn read of two writers fails it), else asks the registry.
struct RootEntry {
    id: AtomicU64,
    span: AtomicU64,
    root: AtomicU64,
    check: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const NO_ROOT: RootEntry = RootEntry {
    id: AtomicU64::new(0),
    span: AtomicU64::new(0),
    root: AtomicU64::new(0),
    check: AtomicU64::new(0),
};
static ROOTS: [RootEntry; ROOT_CACHE] = [NO_ROOT; ROOT_CACHE];

/// Fibonacci hashing's multiplier: an odd constant, so multiplying is a bijection.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

fn root_entry(id: u64) -> &'static RootEntry {
    // Tracing's ids are consecutive slab indexes: the high bits of the product spread them.
    const _: () = assert!(ROOT_CACHE.is_power_of_two());
    &ROOTS[(id.wrapping_mul(GOLDEN) >> (64 - ROOT_CACHE.trailing_zeros())) as usize]
}

/// A word that matches only the (id, span, root) it was made from: a bijection of the three
/// words' rotated xor (no bit forced, which would pair up combinations one bit apart, and
/// tracing's ids differ in single generation bits), so a torn read (words of two writes) fails
/// it unless the combinations are equal; never 0 (an empty entry).
fn root_check(id: u64, ids: SpanIds) -> u64 {
    match (id ^ ids.span.rotate_left(21) ^ ids.root.rotate_left(42)).wrapping_mul(GOLDEN) {
        0 => 1,
        c => c,
    }
}

fn cache_ids(id: u64, ids: SpanIds) {
    let e = root_entry(id);
    e.id.store(id, Ordering::Relaxed);
    e.span.store(ids.span, Ordering::Relaxed);
    e.root.store(ids.root, Ordering::Relaxed);
    e.check.store(root_check(id, ids), Ordering::Relaxed);
}

fn cached_ids(id: u64) -> Option<SpanIds> {
    let e = root_entry(id);
    let (eid, ids, check) = (
        e.id.load(Ordering::Relaxed),
        SpanIds {
            span: e.span.load(Ordering::Relaxed),
            root: e.root.load(Ordering::Relaxed),
        },
        e.check.load(Ordering::Relaxed),
    );
    (eid == id && check == root_check(id, ids)).then_some(ids)
}

impl FerroprofLayer {
    /// The id the samples of span `id` carry: its OpenTelemetry span id when it has one.
    fn published_id(&self, id: &Id) -> u64 {
        #[cfg(feature = "opentelemetry")]
        if let Some(otel) = self.otel_span_id(id) {
            return otel;
        }
        id.into_u64()
    }

    /// The OpenTelemetry span id `tracing-opentelemetry` gave span `id`, if any. Takes the
    /// span's extensions: not to be called while holding them.
    #[cfg(feature = "opentelemetry")]
    fn otel_span_id(&self, id: &Id) -> Option<u64> {
        use opentelemetry::trace::TraceContextExt;
        let dispatch = self.dispatch.get()?.upgrade()?;
        let cx = tracing_opentelemetry::get_otel_context(id, &dispatch)?;
        let span = cx.span();
        let sc = span.span_context();
        sc.is_valid()
            .then(|| u64::from_be_bytes(sc.span_id().to_bytes()))
            .filter(|&v| v != 0)
    }
}

/// The ids of span `span`, from its entry or, when that was taken over, its extensions.
fn ids_of<'a, S>(span: &tracing_subscriber::registry::SpanRef<'a, S>) -> Option<SpanIds>
where
    S: for<'l> LookupSpan<'l>,
{
    let id = span.id().into_u64();
    cached_ids(id).or_else(|| {
        let ids = span.extensions().get::<SpanIds>().copied()?;
        cache_ids(id, ids);
        Some(ids)
    })
}

impl<S> Layer<S> for FerroprofLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    #[cfg(feature = "opentelemetry")]
    fn on_register_dispatch(&self, subscriber: &tracing_core::Dispatch) {
        let _ = self.dispatch.set(subscriber.downgrade());
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let published = self.published_id(id);
        let Some(span) = ctx.span(id) else {
            return;
        };
        if let Some(parent) = span.parent() {
            // A parent made before the layer was installed has no ids: its tracing ids then.
            let root = ids_of(&parent).map_or_else(
                || {
                    parent
                        .scope()
                        .last()
                        .map_or(parent.id().into_u64(), |r| r.id().into_u64())
                },
                |p| p.root,
            );
            let ids = SpanIds {
                span: published,
                root,
            };
            cache_ids(id.into_u64(), ids);
            span.extensions_mut().insert(ids);
            return; // only root spans name an endpoint
        }
        let ids = SpanIds {
            span: published,
            root: published,
        };
        cache_ids(id.into_u64(), ids);
        span.extensions_mut().insert(ids);
        let mut v = EndpointVisitor {
            field: &self.endpoint_field,
            found: None,
        };
        attrs.record(&mut v);
        let endpoint = match v.found {
            Some(e) => Cow::Owned(e),
            None => Cow::Borrowed(span.name()),
        };
        span.extensions_mut().insert(RootEndpoint(endpoint));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else {
            return;
        };
        let mut v = EndpointVisitor {
            field: &self.endpoint_field,
            found: None,
        };
        values.record(&mut v);
        if let Some(e) = v.found {
            if let Some(root) = span.extensions_mut().get_mut::<RootEndpoint>() {
                root.0 = Cow::Owned(e);
            }
        }
    }

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        let span_id = id.into_u64();
        let _ = STACK.try_with(|stack| {
            let Ok(mut stack) = stack.try_borrow_mut() else {
                return;
            };
            if stack.len() >= MAX_DEPTH {
                return;
            }
            // Known since the span's creation, unless another span took its cache entry.
            let ids = match cached_ids(span_id) {
                Some(ids) => ids,
                None => {
                    let Some(span) = ctx.span(id) else {
                        return;
                    };
                    match ids_of(&span) {
                        Some(ids) => ids,
                        // Created before the layer was installed: its tracing ids.
                        None => SpanIds {
                            span: span_id,
                            root: span.scope().last().map_or(span_id, |r| r.id().into_u64()),
                        },
                    }
                }
            };
            let Some(prev) = labels::replace_span(ids.span, ids.root) else {
                return;
            };
            if stack.len() == stack.capacity() {
                // The stack is the profiler's memory, not the application's.
                crate::tls::with_guard(|| stack.reserve(16));
            }
            stack.push(Entered { id: span_id, prev });
        });
    }

    fn on_exit(&self, id: &Id, _ctx: Context<'_, S>) {
        let span_id = id.into_u64();
        let _ = STACK.try_with(|stack| {
            let Ok(mut stack) = stack.try_borrow_mut() else {
                return;
            };
            let Some(i) = stack.iter().rposition(|e| e.id == span_id) else {
                return; // entered before the layer was installed, or past MAX_DEPTH
            };
            // The usual exit is of the span entered last.
            let gone = if i + 1 == stack.len() {
                stack.pop()
            } else {
                Some(stack.remove(i))
            };
            let Some(gone) = gone else { return };
            match stack.get_mut(i) {
                // Exited out of order: the enter above it now restores what this one replaced.
                Some(above) => above.prev = gone.prev,
                None => {
                    labels::replace_span(gone.prev.0, gone.prev.1);
                }
            }
        });
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else {
            return;
        };
        let ext = span.extensions();
        if let Some(RootEndpoint(endpoint)) = ext.get::<RootEndpoint>() {
            let root = ext.get::<SpanIds>().map_or(id.into_u64(), |ids| ids.root);
            labels::record_endpoint(root, endpoint);
        }
    }
}
