//! The memory pages live in while the tiers hold them in host memory: a fixed arena of page-sized
//! slots (on a GPU worker, one pinned allocation, so copies between the pool and a page are DMA
//! the engine need not wait for), with the heap as overflow.
//!
//! - [`HostMemory`] is one allocation the arena is cut from: page-locked memory from the GPU's
//!   driver ([`crate::backend::Backend::host_memory`]) or ordinary heap memory ([`HeapMemory`],
//!   tests).
//! - [`PageArena::page`] hands out a free slot as a [`Page`], or a heap page when every slot is in
//!   use (counted: [`PageArena::overflow_pages`]). A page's slot returns to the arena when the
//!   page is dropped, so a page evicted from the host tier while the disk writer or the engine
//!   still reads it keeps its memory until they are done.
//! - A slot is handed to one page at a time (the free list holds each index once), so a page's
//!   bytes are its own.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One allocation of host memory that an arena is cut from. It stays valid, at the same address,
/// until it is dropped.
pub trait HostMemory: Send + Sync {
    /// The first byte.
    fn base(&self) -> *mut u8;
    /// Its length in bytes.
    fn bytes(&self) -> usize;
    /// What it is, for logs: `pinned` or `heap`.
    fn kind(&self) -> &'static str;
}

/// Heap memory as a [`HostMemory`] (zeroed).
pub struct HeapMemory {
    ptr: *mut u8,
    len: usize,
    kind: &'static str,
}

// SAFETY: the allocation is owned; access to its bytes is arbitrated by the arena's free list.
unsafe impl Send for HeapMemory {}
// SAFETY: as above.
unsafe impl Sync for HeapMemory {}

impl HeapMemory {
    pub fn new(len: usize) -> HeapMemory {
        HeapMemory::labelled(len, "heap")
    }

    /// Heap memory that reports itself as `kind` (tests stand it in for pinned memory).
    pub fn labelled(len: usize, kind: &'static str) -> HeapMemory {
        let boxed: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        HeapMemory { ptr: Box::into_raw(boxed).cast::<u8>(), len, kind }
    }
}

impl Drop for HeapMemory {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` came from `Box::into_raw` of a boxed slice of `len` bytes.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

impl HostMemory for HeapMemory {
    fn base(&self) -> *mut u8 {
        self.ptr
    }
    fn bytes(&self) -> usize {
        self.len
    }
    fn kind(&self) -> &'static str {
        self.kind
    }
}

struct ArenaInner {
    memory: Box<dyn HostMemory>,
    page_bytes: usize,
    slots: usize,
    free: Mutex<Vec<usize>>,
    overflow: AtomicU64,
}

/// Allocates a [`HostMemory`] of the bytes asked for (`None`: ordinary heap pages will do), or
/// says why it cannot.
pub type HostAlloc<'a> = &'a dyn Fn(usize) -> Result<Option<Box<dyn HostMemory>>, String>;

/// Page-sized slots of one [`HostMemory`]; a cheap handle (clone it freely).
#[derive(Clone)]
pub struct PageArena {
    inner: Arc<ArenaInner>,
}

impl std::fmt::Debug for PageArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageArena")
            .field("kind", &self.inner.memory.kind())
            .field("slots", &self.inner.slots)
            .field("free", &self.free_slots())
            .finish()
    }
}

impl PageArena {
    /// Cuts `memory` into `memory.len() / page_bytes` slots (`page_bytes > 0`).
    pub fn new(memory: Box<dyn HostMemory>, page_bytes: usize) -> PageArena {
        assert!(page_bytes > 0, "pages of 0 bytes");
        let slots = memory.bytes() / page_bytes;
        let inner = ArenaInner {
            memory,
            page_bytes,
            slots,
            // Lowest slot first out (popped from the end).
            free: Mutex::new((0..slots).rev().collect()),
            overflow: AtomicU64::new(0),
        };
        PageArena { inner: Arc::new(inner) }
    }

    /// A page of `page_bytes`: a free slot (its bytes are what the slot last held), else a zeroed
    /// heap page.
    pub fn page(&self) -> Page {
        let slot = self.inner.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match slot {
            Some(index) => Page { mem: Mem::Slot { arena: self.inner.clone(), index } },
            None => {
                self.inner.overflow.fetch_add(1, Ordering::Relaxed);
                Page::heap(self.inner.page_bytes)
            }
        }
    }

    pub fn slots(&self) -> usize {
        self.inner.slots
    }

    pub fn free_slots(&self) -> usize {
        self.inner.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Pages handed out from the heap because every slot was in use.
    pub fn overflow_pages(&self) -> u64 {
        self.inner.overflow.load(Ordering::Relaxed)
    }

    /// `pinned` or `heap`.
    pub fn kind(&self) -> &'static str {
        self.inner.memory.kind()
    }

    pub fn page_bytes(&self) -> usize {
        self.inner.page_bytes
    }
}

enum Mem {
    Heap(Box<[u8]>),
    Slot { arena: Arc<ArenaInner>, index: usize },
}

/// A page's bytes: an arena slot (given back on drop) or a heap allocation.
pub struct Page {
    mem: Mem,
}

impl Page {
    /// A zeroed page of `len` bytes on the heap.
    pub fn heap(len: usize) -> Page {
        Page { mem: Mem::Heap(vec![0u8; len].into_boxed_slice()) }
    }

    /// Whether the page lives in an arena slot.
    pub fn in_arena(&self) -> bool {
        matches!(self.mem, Mem::Slot { .. })
    }
}

impl From<Vec<u8>> for Page {
    fn from(v: Vec<u8>) -> Page {
        Page { mem: Mem::Heap(v.into_boxed_slice()) }
    }
}

impl Deref for Page {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.mem {
            Mem::Heap(b) => b,
            Mem::Slot { arena, index } => {
                // SAFETY: slot `index` lies inside the arena's memory (index < slots) and belongs
                // to this page alone until it is dropped; the memory outlives `arena`.
                unsafe {
                    std::slice::from_raw_parts(
                        arena.memory.base().add(index * arena.page_bytes),
                        arena.page_bytes,
                    )
                }
            }
        }
    }
}

impl DerefMut for Page {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.mem {
            Mem::Heap(b) => b,
            Mem::Slot { arena, index } => {
                // SAFETY: as for `deref`, and `&mut self` makes this the only view.
                unsafe {
                    std::slice::from_raw_parts_mut(
                        arena.memory.base().add(*index * arena.page_bytes),
                        arena.page_bytes,
                    )
                }
            }
        }
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        if let Mem::Slot { arena, index } = &self.mem {
            arena.free.lock().unwrap_or_else(|e| e.into_inner()).push(*index);
        }
    }
}

impl PartialEq for Page {
    fn eq(&self, other: &Page) -> bool {
        self[..] == other[..]
    }
}

impl Eq for Page {}

impl std::fmt::Debug for Page {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Page({} bytes{})", self.len(), if self.in_arena() { ", arena" } else { "" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_handed_out_once_and_come_back_when_their_page_is_dropped() {
        let arena = PageArena::new(Box::new(HeapMemory::new(3 * 8 + 5)), 8);
        assert_eq!((arena.slots(), arena.free_slots()), (3, 3));
        let mut pages: Vec<Page> = (0..3).map(|_| arena.page()).collect();
        assert!(pages.iter().all(Page::in_arena));
        assert_eq!(arena.free_slots(), 0);
        // Each page's bytes are its own.
        for (i, p) in pages.iter_mut().enumerate() {
            p.fill(i as u8 + 1);
        }
        for (i, p) in pages.iter().enumerate() {
            assert!(p.iter().all(|&b| b == i as u8 + 1), "page {i} was written by another");
        }
        // Full: the heap takes over, and says so.
        let extra = arena.page();
        assert!(!extra.in_arena());
        assert_eq!((extra.len(), arena.overflow_pages()), (8, 1));
        drop(extra);
        assert_eq!(arena.free_slots(), 0, "a heap page is not an arena slot");
        let second = pages.remove(1);
        drop(second);
        assert_eq!(arena.free_slots(), 1);
        let again = arena.page();
        assert!(again.in_arena());
        assert!(again.iter().all(|&b| b == 2), "the slot freed is the one handed out again");
        drop(pages);
        drop(again);
        assert_eq!(arena.free_slots(), 3);
    }

    #[test]
    fn pages_outlive_the_arena_handle() {
        let arena = PageArena::new(Box::new(HeapMemory::new(16)), 16);
        let mut page = arena.page();
        drop(arena);
        page.copy_from_slice(&[7u8; 16]);
        assert_eq!(&page[..], &[7u8; 16]);
    }
}
