//! Compressed debug sections (zlib, as distributions ship them) inflated whole, by parts, or
//! only for the units a pass needs.

/// Inflates zlib `data` through a small window, handing each piece to `take(at, piece)` (`at`:
/// where the piece starts in the inflated stream) while it returns true and the stream lasts,
/// and first to `tee` (the disk cache's writer). `None` on a corrupt stream.
pub(super) fn inflate_stream(
    data: &[u8],
    tee: &mut dyn FnMut(&[u8]),
    mut take: impl FnMut(usize, &[u8]) -> bool,
) -> Option<()> {
    let mut window = vec![0u8; 64 * 1024];
    let mut z = flate2::Decompress::new(true);
    let mut at = 0usize;
    loop {
        let read = z.total_in() as usize;
        let before = z.total_out();
        let status = z
            .decompress(
                data.get(read..)?,
                &mut window,
                flate2::FlushDecompress::None,
            )
            .ok()?;
        let n = (z.total_out() - before) as usize;
        tee(&window[..n]);
        let more = take(at, &window[..n]);
        at += n;
        if !more || status == flate2::Status::StreamEnd || n == 0 && z.total_in() as usize == read {
            return Some(());
        }
    }
}

/// Inflates zlib `data` (`size` bytes inflated) into a zeroed buffer, writing only the byte
/// ranges `wanted` (sorted): the stream is inflated through a small window, so the memory
/// touched is the window and the wanted parts.
pub(super) fn inflate_parts(
    data: &[u8],
    size: usize,
    wanted: &[(usize, usize)],
    tee: &mut dyn FnMut(&[u8]),
) -> Option<Box<[u8]>> {
    let mut buf = vec![0u8; size].into_boxed_slice();
    let end = wanted.iter().map(|w| w.1).max().unwrap_or(0).min(size);
    if end == 0 {
        return Some(buf);
    }
    inflate_stream(data, tee, |at, piece| {
        for &(from, to) in wanted {
            let (lo, hi) = (from.max(at), to.min(at + piece.len()).min(size));
            if lo < hi {
                buf[lo..hi].copy_from_slice(&piece[lo - at..hi - at]);
            }
        }
        at + piece.len() < end
    })?;
    Some(buf)
}

/// Inflates zlib `data` (`size` bytes inflated) into a zeroed buffer, writing only the DWARF
/// units (or line programs) starting at `starts` (sorted, distinct), each as long as the
/// initial length it starts with, read once its first bytes are out. The stream is inflated
/// through a small window and only as far as the end of the last one.
pub(super) fn inflate_units_of(
    data: &[u8],
    size: usize,
    starts: &[usize],
    little: bool,
    tee: &mut dyn FnMut(&[u8]),
) -> Option<Box<[u8]>> {
    let mut buf = vec![0u8; size].into_boxed_slice();
    if starts.is_empty() {
        return Some(buf);
    }
    // The next unit to copy, and its end once its header is out.
    let mut k = 0usize;
    let mut end: Option<usize> = None;
    inflate_stream(data, tee, |at, piece| {
        let top = (at + piece.len()).min(size);
        while let Some(&from) = starts.get(k).filter(|&&f| f < top) {
            // Until its length is known, a unit runs to the section's end.
            let to = end.unwrap_or(size).min(size);
            let (lo, hi) = (from.max(at), to.min(top));
            if lo < hi {
                buf[lo..hi].copy_from_slice(&piece[lo - at..hi - at]);
            }
            if end.is_none() {
                match unit_extent(&buf[from..top], little) {
                    Some(len) => {
                        end = Some(from.saturating_add(len));
                        continue;
                    }
                    None => break,
                }
            }
            if to > top {
                break;
            }
            k += 1;
            end = None;
        }
        k < starts.len() && top < size
    })?;
    Some(buf)
}

/// The bytes a DWARF unit or line program starting with `head` spans, header included, from
/// its initial length; `None` until enough of it is there.
pub(super) fn unit_extent(head: &[u8], little: bool) -> Option<usize> {
    let word = |b: &[u8]| {
        let mut v = 0u64;
        for (i, &x) in b.iter().enumerate() {
            let shift = if little { 8 * i } else { 8 * (b.len() - 1 - i) };
            v |= u64::from(x) << shift;
        }
        usize::try_from(v).unwrap_or(usize::MAX)
    };
    let short = word(head.get(..4)?);
    if short == 0xffff_ffff {
        // 64-bit DWARF: the length follows in 8 bytes.
        Some(word(head.get(4..12)?).saturating_add(12))
    } else {
        Some(short.saturating_add(4))
    }
}
