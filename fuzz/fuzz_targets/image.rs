//! The image tasks' input, as the gateway converts it: the header probe under the pixel limit
//! (`tasks::image::convert::probe`), the decode (PNG, JPEG, WebP) with its EXIF orientation,
//! and every fit a task row can ask for: MTCNN's pyramid from the whole decoded image, P-Net
//! proposals letterboxed or stretched, and any image model's tensor (resize and centre crop,
//! letterbox, stretch; NCHW or NHWC; FP32, FP16 or UINT8), each through its task's own plan
//! ([`vramgate_fuzz::image_converters`]). Images declaring more than
//! [`vramgate_fuzz::MAX_PIXELS`] are refused from their header, as the task row says.
//!
//! Checked: no refusal is `internal`; every tensor holds what its shape says, only finite
//! values, and reaches the worker as it left ([`vramgate_fuzz::check_calls`]).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vramgate_fuzz::convert_with_every_row(vramgate_fuzz::image_converters, data, |_, converted| vramgate_fuzz::check_finite(converted));
});
