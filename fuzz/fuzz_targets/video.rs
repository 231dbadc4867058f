//! The picture tasks' video input, as the gateway reads it (`video`): the container sniffed
//! from the first bytes, then, for what looks like a video, the whole path through FFmpeg
//! itself: the sealed memory file, `ffmpeg` under the sandbox's limits, its input dump read as
//! the header and checked against the limits, the key frames decoded and read back (PPM frames,
//! `showinfo` times). The readers of FFmpeg's output are also fed the input directly: its lines
//! as the input dump and as `showinfo` lines, its bytes as the PPM stream.
//!
//! Checked: no refusal is `internal` (FFmpeg's output, whatever the input, is read without a
//! malformed stream); a probe that passes is within the limits; every frame is a binary PPM
//! that the picture decoder reads, within the pixel limit, with a time where FFmpeg gave one.
//! Each input that sniffs as a video costs a short FFmpeg process, so this target runs tens, not
//! thousands, of inputs a second.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vramgate_gateway::tasks::image::decode_rgb;
use vramgate_gateway::video::ffmpeg::{self, VideoFile};
use vramgate_gateway::video::{sniff, Named, Policy, VideoOptions};
use vramgate_shared::events::ErrorKind;

/// Frame pixels allowed, as a task row's `video.max_pixels`.
const MAX_PIXELS: u64 = 1 << 20;

fn options() -> &'static VideoOptions {
    static OPTIONS: OnceLock<VideoOptions> = OnceLock::new();
    OPTIONS.get_or_init(|| {
        let options = VideoOptions { max_frames: 8, max_pixels: MAX_PIXELS, decode_timeout_seconds: 5.0, ..VideoOptions::default() };
        options.validate().expect("the fuzz target's task row is valid");
        options
    })
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime"))
}

fn check_frame(ppm: &[u8]) {
    let (image, format) = decode_rgb(ppm, MAX_PIXELS).expect("a frame is a picture the tasks read");
    assert_eq!(format, "ppm");
    assert!(u64::from(image.width()) * u64::from(image.height()) <= MAX_PIXELS);
}

fuzz_target!(|data: &[u8]| {
    let options = options();
    let mut header = ffmpeg::Header::default();
    for line in String::from_utf8_lossy(data).lines() {
        if let Some(Ok(probed)) = header.read(line, options) {
            assert!(u64::from(probed.width) * u64::from(probed.height) <= options.max_pixels);
        }
        let _ = ffmpeg::showinfo_time(line);
    }
    runtime().block_on(async {
        let mut stream = data;
        while let Ok(Some(ppm)) = ffmpeg::read_ppm(&mut stream, MAX_PIXELS).await {
            // A header the reader takes may still carry pixels the decoder refuses: no panic.
            let _ = decode_rgb(&ppm, MAX_PIXELS);
        }
    });
    if sniff(data).is_none() {
        return;
    }
    runtime().block_on(async {
        let file = VideoFile::new(data).expect("a memory file");
        let mut decoder = ffmpeg::decode(&file, options, Policy::Named(Named::Intra)).expect("the decoder starts");
        let probed = match decoder.header().await {
            Ok(probed) => probed,
            Err(failure) => {
                assert_ne!(failure.kind, ErrorKind::Internal, "{}", failure.message);
                return;
            }
        };
        assert!(u64::from(probed.width) * u64::from(probed.height) <= options.max_pixels);
        while let Some(next) = decoder.next().await {
            match next {
                Ok(frame) => check_frame(&frame.ppm),
                Err(failure) => assert_ne!(failure.kind, ErrorKind::Internal, "{}", failure.message),
            }
        }
    });
});
