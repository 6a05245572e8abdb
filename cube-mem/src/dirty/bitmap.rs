//! The pages that changed: one bit per 4 KiB page per region of guest memory
//! ([`DirtyBitmap`]), and the runs of dirty pages in it ([`DirtyRun`]).

use super::error::DirtyError;
use crate::guest_memory::{GuestMemory, PAGE_SIZE};

/// One bit per 4 KiB page, per region of guest memory. Bit `p` of region `r` lives in
/// `words(r)[p / 64]` at bit `p % 64`: the layout of `KVM_GET_DIRTY_LOG` and of
/// vm-memory's `AtomicBitmap`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtyBitmap {
    regions: Vec<RegionBits>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct RegionBits {
    pages: usize,
    words: Vec<u64>,
}

impl RegionBits {
    fn new(pages: usize) -> Self {
        Self {
            pages,
            words: vec![0; pages.div_ceil(64)],
        }
    }
}

/// A maximal range of consecutive dirty pages inside one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirtyRun {
    /// Index of the region.
    pub region: usize,
    /// First dirty page, counted from the region's start.
    pub first_page: usize,
    /// Number of dirty pages in the run (at least 1).
    pub pages: usize,
}

impl DirtyRun {
    /// Byte offset of the run inside its region.
    pub fn offset(&self) -> usize {
        self.first_page * PAGE_SIZE
    }

    /// Length of the run in bytes.
    pub fn len(&self) -> usize {
        self.pages * PAGE_SIZE
    }

    /// Always false: a run has at least one page.
    pub fn is_empty(&self) -> bool {
        self.pages == 0
    }
}

impl DirtyBitmap {
    /// An all-clean bitmap for regions of the given page counts.
    pub fn new(region_pages: &[usize]) -> Self {
        Self {
            regions: region_pages.iter().map(|&p| RegionBits::new(p)).collect(),
        }
    }

    /// An all-clean bitmap shaped like `mem`.
    pub fn for_memory(mem: &GuestMemory) -> Self {
        let pages: Vec<usize> = mem.regions().iter().map(|r| r.pages()).collect();
        Self::new(&pages)
    }

    /// Builds a bitmap from one `KVM_GET_DIRTY_LOG` result per region, given as
    /// `(pages in the region, words)`. Bits past a region's last page are ignored.
    pub fn from_kvm_log(region_logs: &[(usize, Vec<u64>)]) -> Result<Self, DirtyError> {
        let pages: Vec<usize> = region_logs.iter().map(|(p, _)| *p).collect();
        let mut bitmap = Self::new(&pages);
        for (region, (_, words)) in region_logs.iter().enumerate() {
            bitmap.or_words(region, words)?;
        }
        Ok(bitmap)
    }

    /// Number of regions.
    pub fn region_count(&self) -> usize {
        self.regions.len()
    }

    /// Pages in `region`, if it exists.
    pub fn region_pages(&self, region: usize) -> Option<usize> {
        self.regions.get(region).map(|r| r.pages)
    }

    /// The raw words of `region`, if it exists.
    pub fn words(&self, region: usize) -> Option<&[u64]> {
        self.regions.get(region).map(|r| r.words.as_slice())
    }

    fn region_mut(&mut self, region: usize) -> Result<&mut RegionBits, DirtyError> {
        let regions = self.regions.len();
        self.regions
            .get_mut(region)
            .ok_or(DirtyError::RegionOutOfRange { region, regions })
    }

    /// Marks `page` of `region` dirty.
    pub fn set(&mut self, region: usize, page: usize) -> Result<(), DirtyError> {
        self.set_range(region, page, 1)
    }

    /// Marks `count` pages starting at `first` in `region` dirty.
    pub fn set_range(
        &mut self,
        region: usize,
        first: usize,
        count: usize,
    ) -> Result<(), DirtyError> {
        let bits = self.region_mut(region)?;
        let end = first
            .checked_add(count)
            .filter(|&e| e <= bits.pages)
            .ok_or(DirtyError::PageOutOfRange {
                region,
                first,
                end: first.saturating_add(count),
                pages: bits.pages,
            })?;
        let mut page = first;
        while page < end {
            let bit = page % 64;
            let take = (64 - bit).min(end - page);
            let mask = if take == 64 {
                u64::MAX
            } else {
                ((1u64 << take) - 1) << bit
            };
            bits.words[page / 64] |= mask;
            page += take;
        }
        Ok(())
    }

    /// Marks `page` of `region` clean; a page that does not exist is left alone.
    pub fn clear_page(&mut self, region: usize, page: usize) {
        if let Some(bits) = self.regions.get_mut(region).filter(|r| page < r.pages) {
            bits.words[page / 64] &= !(1 << (page % 64));
        }
    }

    /// Whether `page` of `region` is dirty; false for pages that do not exist.
    pub fn get(&self, region: usize, page: usize) -> bool {
        self.regions
            .get(region)
            .filter(|r| page < r.pages)
            .is_some_and(|r| r.words[page / 64] & (1 << (page % 64)) != 0)
    }

    /// ORs raw words (KVM / `AtomicBitmap` layout) into `region`. Bits past the
    /// region's last page are ignored.
    pub fn or_words(&mut self, region: usize, words: &[u64]) -> Result<(), DirtyError> {
        let bits = self.region_mut(region)?;
        if words.len() != bits.words.len() {
            return Err(DirtyError::WordCount {
                region,
                expected: bits.words.len(),
                actual: words.len(),
            });
        }
        for (dst, src) in bits.words.iter_mut().zip(words) {
            *dst |= *src;
        }
        let tail = bits.pages % 64;
        if let (Some(last), true) = (bits.words.last_mut(), tail != 0) {
            *last &= (1u64 << tail) - 1;
        }
        Ok(())
    }

    /// ORs `other` into `self`; both must have the same shape.
    pub fn or(&mut self, other: &DirtyBitmap) -> Result<(), DirtyError> {
        if self.regions.len() != other.regions.len()
            || self
                .regions
                .iter()
                .zip(&other.regions)
                .any(|(a, b)| a.pages != b.pages)
        {
            return Err(DirtyError::ShapeMismatch);
        }
        for (a, b) in self.regions.iter_mut().zip(&other.regions) {
            for (x, y) in a.words.iter_mut().zip(&b.words) {
                *x |= *y;
            }
        }
        Ok(())
    }

    /// Total number of dirty pages.
    pub fn count(&self) -> usize {
        (0..self.regions.len())
            .map(|r| self.region_count_dirty(r))
            .sum()
    }

    /// Number of dirty pages in `region` (0 if it does not exist).
    pub fn region_count_dirty(&self, region: usize) -> usize {
        self.regions
            .get(region)
            .map_or(0, |r| r.words.iter().map(|w| w.count_ones() as usize).sum())
    }

    /// Whether no page is dirty.
    pub fn is_empty(&self) -> bool {
        self.regions.iter().all(|r| r.words.iter().all(|&w| w == 0))
    }

    /// Marks every page clean.
    pub fn clear(&mut self) {
        for r in &mut self.regions {
            r.words.fill(0);
        }
    }

    /// The dirty pages of `region` in ascending order.
    pub fn pages(&self, region: usize) -> impl Iterator<Item = usize> + '_ {
        self.runs()
            .filter(move |run| run.region == region)
            .flat_map(|run| run.first_page..run.first_page + run.pages)
    }

    /// Every dirty page as `(region, page)`, in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.runs().flat_map(|run| {
            (run.first_page..run.first_page + run.pages).map(move |p| (run.region, p))
        })
    }

    /// Maximal runs of consecutive dirty pages, region by region, in ascending order.
    pub fn runs(&self) -> DirtyRuns<'_> {
        DirtyRuns {
            bitmap: self,
            region: 0,
            page: 0,
        }
    }
}

/// Iterator over the [`DirtyRun`]s of a [`DirtyBitmap`].
#[derive(Debug)]
pub struct DirtyRuns<'a> {
    bitmap: &'a DirtyBitmap,
    region: usize,
    page: usize,
}

impl Iterator for DirtyRuns<'_> {
    type Item = DirtyRun;

    fn next(&mut self) -> Option<DirtyRun> {
        while let Some(bits) = self.bitmap.regions.get(self.region) {
            if let Some(first) = next_set(&bits.words, self.page, bits.pages) {
                let end = next_clear(&bits.words, first, bits.pages);
                self.page = end;
                return Some(DirtyRun {
                    region: self.region,
                    first_page: first,
                    pages: end - first,
                });
            }
            self.region += 1;
            self.page = 0;
        }
        None
    }
}

/// First set bit at or after `from`, below `limit`.
fn next_set(words: &[u64], from: usize, limit: usize) -> Option<usize> {
    let mut i = from;
    while i < limit {
        let w = words.get(i / 64)? >> (i % 64);
        if w != 0 {
            let found = i + w.trailing_zeros() as usize;
            return (found < limit).then_some(found);
        }
        i = (i / 64 + 1) * 64;
    }
    None
}

/// First clear bit at or after `from`, or `limit` if none below it.
fn next_clear(words: &[u64], from: usize, limit: usize) -> usize {
    let mut i = from;
    while i < limit {
        let Some(word) = words.get(i / 64) else {
            return limit;
        };
        let w = !word >> (i % 64);
        if w != 0 {
            return (i + w.trailing_zeros() as usize).min(limit);
        }
        i = (i / 64 + 1) * 64;
    }
    limit
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_count_runs() {
        let mut b = DirtyBitmap::new(&[130, 5]);
        assert!(b.is_empty());
        b.set(0, 0).unwrap();
        b.set_range(0, 62, 5).unwrap();
        b.set(0, 129).unwrap();
        b.set(1, 4).unwrap();
        assert!(b.get(0, 63) && b.get(0, 66) && !b.get(0, 67) && !b.get(0, 130));
        assert!(!b.get(2, 0));
        assert_eq!(b.count(), 8);
        assert_eq!(b.region_count_dirty(1), 1);
        let runs: Vec<_> = b
            .runs()
            .map(|r| (r.region, r.first_page, r.pages))
            .collect();
        assert_eq!(runs, vec![(0, 0, 1), (0, 62, 5), (0, 129, 1), (1, 4, 1)]);
        assert_eq!(b.pages(1).collect::<Vec<_>>(), vec![4]);
        assert_eq!(b.iter().count(), 8);
        assert_eq!(b.iter().last(), Some((1, 4)));
        assert!(matches!(
            b.set(0, 130),
            Err(DirtyError::PageOutOfRange { region: 0, .. })
        ));
        assert!(matches!(
            b.set_range(1, 3, usize::MAX),
            Err(DirtyError::PageOutOfRange { .. })
        ));
        assert!(matches!(
            b.set(2, 0),
            Err(DirtyError::RegionOutOfRange {
                region: 2,
                regions: 2
            })
        ));
        b.clear();
        assert!(b.is_empty());
        assert_eq!(b.runs().count(), 0);
    }

    #[test]
    fn full_and_word_spanning_runs() {
        let mut b = DirtyBitmap::new(&[256]);
        b.set_range(0, 0, 256).unwrap();
        assert_eq!(
            b.runs().collect::<Vec<_>>(),
            vec![DirtyRun {
                region: 0,
                first_page: 0,
                pages: 256
            }]
        );
        b.clear();
        b.set_range(0, 63, 66).unwrap();
        let run = b.runs().next().unwrap();
        assert_eq!((run.first_page, run.pages), (63, 66));
        assert_eq!((run.offset(), run.len()), (63 * 4096, 66 * 4096));
        assert_eq!(b.words(0).unwrap()[1], u64::MAX);
    }

    #[test]
    fn or_and_kvm_words() {
        let mut a = DirtyBitmap::from_kvm_log(&[(70, vec![0b101, u64::MAX])]).unwrap();
        // Bits past page 69 are dropped.
        assert_eq!(a.count(), 2 + 6);
        let mut b = DirtyBitmap::new(&[70]);
        b.set(0, 1).unwrap();
        a.or(&b).unwrap();
        assert_eq!(a.pages(0).take(3).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert!(matches!(
            a.or(&DirtyBitmap::new(&[71])),
            Err(DirtyError::ShapeMismatch)
        ));
        assert!(matches!(
            a.or_words(0, &[0]),
            Err(DirtyError::WordCount {
                expected: 2,
                actual: 1,
                ..
            })
        ));
    }
}
