//! The C ABI between weft and provider libraries: `#[repr(C)]` types and version constants only,
//! no logic (see ARCHITECTURE.md).

/// ABI major version: a loader refuses a provider whose major differs.
pub const WEFT_ABI_MAJOR: u16 = 1;
/// ABI minor version: a loader accepts providers with a minor not newer than its own.
pub const WEFT_ABI_MINOR: u16 = 0;
/// `major << 16 | minor`, the first field of every entry table.
pub const WEFT_ABI_VERSION: u32 = ((WEFT_ABI_MAJOR as u32) << 16) | WEFT_ABI_MINOR as u32;
