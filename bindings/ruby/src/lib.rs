//! Ruby extension: `Ferroprof::StackRecorder` (the seed's stack and heap recorders, on
//! `ferroprof-recorder`) and `Ferroprof::Native` (the sampling profiler behind `Ferroprof.start`).
//!
//! Every entry point runs with the GVL held (Ruby calls it) and is wrapped by [`guard`], so a
//! panic becomes a Ruby exception instead of unwinding into the VM.

mod capture;
mod context;
mod cpu_engine;
mod export;
mod heap;
mod perf;
mod profiler;
mod recorder;

use std::panic::{catch_unwind, AssertUnwindSafe};

use magnus::value::Lazy;
use magnus::{prelude::*, Error, ExceptionClass, RModule, Ruby};

/// `Ferroprof::Error` (a `RuntimeError`): what the recorder reports that is not the caller's
/// argument mistake.
static ERROR: Lazy<ExceptionClass> = Lazy::new(|ruby| {
    let module: RModule = ruby
        .class_object()
        .const_get("Ferroprof")
        .expect("Ferroprof is defined by init before any use");
    module
        .const_get("Error")
        .expect("Ferroprof::Error is defined by init before any use")
});

/// A `Ferroprof::Error` with `msg`.
fn error(ruby: &Ruby, msg: impl Into<std::borrow::Cow<'static, str>>) -> Error {
    Error::new(ruby.get_inner(&ERROR), msg)
}

/// Locks `m`; a panic elsewhere never leaves our data half-written in a way that matters here.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An `ArgumentError` with `msg`.
fn arg_error(ruby: &Ruby, msg: impl Into<std::borrow::Cow<'static, str>>) -> Error {
    Error::new(ruby.exception_arg_error(), msg)
}

/// Runs `f`, turning a panic into a `Ferroprof::Error` (magnus would raise `fatal`, which ends
/// the program).
fn guard<T>(ruby: &Ruby, f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            Err(error(ruby, format!("ferroprof internal error: {what}")))
        }
    }
}

#[magnus::init]
fn init(ruby: &Ruby) -> Result<(), Error> {
    let module = ruby.define_module("Ferroprof")?;
    module.define_error("Error", ruby.exception_runtime_error())?;
    recorder::init(ruby, module)?;
    profiler::init(ruby, module)?;
    export::init(ruby, module)?;
    Ok(())
}
