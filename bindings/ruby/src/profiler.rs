//! The sampling profiler behind `Ferroprof.start` (filled in below).

use magnus::{Error, RModule, Ruby};

pub fn init(_ruby: &Ruby, _module: RModule) -> Result<(), Error> {
    Ok(())
}
