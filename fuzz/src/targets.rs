//! Each fuzz target's body, as a function of the input's bytes: `fuzz_targets/<target>.rs` hands
//! it to libFuzzer, and the services' test suite (`tests/tests/fuzz_seeds.rs`) runs every
//! committed seed through it, so a seed that a change makes fail fails the ordinary tests, not
//! only a fuzz run. A panic is a finding.

use super as fuzz;

pub mod event_json {
    //! A record's value as the gateway reads it: `record::read_request` (JSON, the request's shape,
    //! its id), then the request's `options` planned by every converter of the task table (each
    //! task's own option checks), then its `input` opened as `record` opens it (`InputSource`:
    //! the `file://` URI resolved beneath an empty root, inline base64 bounded and decoded).
    //!
    //! Checked: a rejection's message and echoed id stay bounded; an accepted request has an id of
    //! 1 to 256 bytes and reads back from its own JSON unchanged (what producers and the
    //! schema's round-trip tests rely on); a refused option is the request's fault
    //! (`invalid_request`), never `internal`; inline input decodes to no more than the bytes
    //! reserved for it before reading.

    use super::fuzz;

    use std::sync::OnceLock;
    use std::time::Duration;

    use vramgate_gateway::input::{FetchError, InputSource, Opened};
    use vramgate_gateway::record::{read_request, MAX_ID_BYTES};
    use vramgate_gateway::tasks::voice::{VoiceTask, WavOptions};
    use vramgate_gateway::tasks::Converter;
    use vramgate_shared::events::{ErrorKind, RequestEvent};
    use vramgate_shared::telemetry::LOG_FIELD_MAX_BYTES;

    /// The input limit of the gateway's default config (`input.max_input_bytes`).
    const MAX_INPUT_BYTES: u64 = 64 << 20;

    struct Gateway {
        converters: Vec<Box<dyn Converter>>,
        input: InputSource,
    }

    fn gateway() -> &'static Gateway {
        static GATEWAY: OnceLock<Gateway> = OnceLock::new();
        GATEWAY.get_or_init(|| {
            let mut converters: Vec<Box<dyn Converter>> = vec![Box::new(VoiceTask::new(WavOptions::default()))];
            converters.extend(fuzz::image_converters());
            converters.extend(fuzz::audio_converters());
            converters.extend(fuzz::tensor_converters());
            let root = fuzz::scratch_dir("input-root");
            let input = InputSource::new(&root, MAX_INPUT_BYTES, Duration::from_secs(1)).expect("the empty input root opens");
            Gateway { converters, input }
        })
    }

    pub fn run(data: &[u8]) {
        let gateway = gateway();
        let request = match read_request(data) {
            Ok(request) => request,
            Err(rejection) => {
                assert!(rejection.failure.message.len() <= 2 * LOG_FIELD_MAX_BYTES + 128, "{} bytes", rejection.failure.message.len());
                assert!(rejection.id.is_none_or(|id| id.len() <= MAX_ID_BYTES));
                assert!(rejection.task.is_none_or(|task| task.len() <= MAX_ID_BYTES));
                return;
            }
        };
        assert!(!request.id.is_empty() && request.id.len() <= MAX_ID_BYTES);
        let json = serde_json::to_vec(&request).expect("a request serialises");
        let again: RequestEvent = serde_json::from_slice(&json).expect("a request reads back from its own json");
        assert_eq!(again, request);

        for converter in &gateway.converters {
            if let Err(failure) = converter.plan(request.options.as_ref()) {
                assert_eq!(failure.kind, ErrorKind::InvalidRequest, "{}", failure.message);
            }
        }

        match gateway.input.open(request.input) {
            Ok(opened @ Opened::Inline(_)) => {
                let reserved = opened.size();
                if let Ok(bytes) = futures::executor::block_on(gateway.input.read(opened)) {
                    assert!(bytes.len() as u64 <= reserved, "{} bytes read, {reserved} reserved", bytes.len());
                }
            }
            // Nothing is beneath the empty root to open.
            Ok(Opened::File { shown, .. }) => panic!("opened {shown} beneath an empty root"),
            // No bucket and no host is configured here: no URI may name an object.
            Ok(Opened::Named(named)) => panic!("named {} with no object storage configured", named.shown),
            Ok(Opened::Object(located)) => panic!("located {} with no object storage configured", located.shown),
            Err(FetchError::TooLarge { size, limit }) => assert!(size > limit),
            Err(_) => {}
        }
    }
}

pub mod wav {
    //! The `voice` task's input, as the gateway converts it: the WAV header probe
    //! (`audio::wav::probe_wav`, the duration limit), the decode (`decode_wav_limited`), the mix
    //! to mono and the resampling to 16 kHz (`rubato`), through the task's own plan
    //! (`tasks::voice`).
    //!
    //! Checked: a header that probes decodes, to exactly the frames, rate and channels the probe
    //! said, every sample finite and in [-1, 1]; the 16 kHz signal has `round(frames · 16000 /
    //! rate)` samples (the resampler's contract), padded to one model window, all finite; the
    //! tensor reaches the worker as it left ([`crate::check_calls`]).

    use super::fuzz;

    use std::sync::{Arc, OnceLock};

    use vramgate_gateway::audio::wav::{decode_wav, probe_wav};
    use vramgate_gateway::tasks::voice::{VoiceTask, WavOptions, MODEL_SAMPLE_RATE, MODEL_WINDOW};
    use vramgate_gateway::tasks::{Converter, Plan};

    fn plan() -> &'static Arc<dyn Plan> {
        static PLAN: OnceLock<Arc<dyn Plan>> = OnceLock::new();
        PLAN.get_or_init(|| {
            let wav = WavOptions { max_audio_seconds: fuzz::MAX_AUDIO_SECONDS, ..WavOptions::default() };
            VoiceTask::new(wav).plan(None).expect("the voice task plans a request without options")
        })
    }

    pub fn run(data: &[u8]) {
        let Some(converted) = fuzz::probe_then_convert(&**plan(), data) else { return };
        fuzz::check_finite(&converted);
        let info = probe_wav(data).expect("the plan's probe passed");
        let audio = decode_wav(data).expect("a wav that probes decodes");
        assert_eq!((audio.frames() as u64, audio.sample_rate, audio.channels), (info.frames, info.sample_rate, info.channels));
        assert!(audio.samples.iter().all(|s| (-1.0..=1.0).contains(s)), "a sample outside [-1, 1]");
        let rate = u64::from(info.sample_rate);
        let resampled = (info.frames * u64::from(MODEL_SAMPLE_RATE) + rate / 2) / rate;
        let shape = &converted.calls[0].inputs[0].shape;
        assert_eq!(shape, &[1, resampled.max(u64::from(MODEL_WINDOW)) as usize], "{} frames at {rate} Hz", info.frames);
    }
}

pub mod image {
    //! The image tasks' input, as the gateway converts it: the header probe under the pixel limit
    //! (`tasks::image::convert::probe`), the decode (PNG, JPEG, WebP) with its EXIF orientation,
    //! and every fit a task row can ask for: MTCNN's pyramid from the whole decoded image, P-Net
    //! proposals letterboxed or stretched, and any image model's tensor (resize and centre crop,
    //! letterbox, stretch; NCHW or NHWC; FP32, FP16 or UINT8), each through its task's own plan
    //! ([`crate::image_converters`]). Images declaring more than
    //! [`crate::MAX_PIXELS`] are refused from their header, as the task row says.
    //!
    //! Checked: no refusal is `internal`; every tensor holds what its shape says, only finite
    //! values, and reaches the worker as it left ([`crate::check_calls`]).

    use super::fuzz;

    pub fn run(data: &[u8]) {
        fuzz::convert_with_every_row(fuzz::image_converters, data, |_, converted| fuzz::check_finite(converted));
    }
}

pub mod compressed_audio {
    //! The `audio` task's input, as the gateway converts it: the container told by its magic, the
    //! header probe with the duration and element limits (`audio::decode::probe`), symphonia's
    //! FLAC, Ogg Vorbis and MP3 decoders (WAV through the gateway's own parser) stopped at the
    //! frame limit (`audio::decode::decode`), the mix to mono, the resampling, and the model input
    //! (the whole signal, or centred frames in FP16), through the task's own plans
    //! ([`crate::audio_converters`]).
    //!
    //! A panic inside symphonia is left to the gateway's guard, which refuses the input
    //! ([`crate::let_symphonia_panics_reach_the_guard`]); any other panic is a finding.
    //!
    //! Checked: no refusal is `internal`; every tensor holds what its shape says, only finite
    //! values, and reaches the worker as it left ([`crate::check_calls`]); whatever
    //! converts had a header that probes, within the duration limit.

    use super::fuzz;

    use vramgate_gateway::audio::decode;

    pub fn run(data: &[u8]) {
        fuzz::convert_with_every_row(fuzz::audio_converters, data, |_, converted| {
            fuzz::check_finite(converted);
            let header = decode::probe(data).expect("converted audio has a header that probes");
            assert!(header.duration_seconds().is_none_or(|s| s <= fuzz::MAX_AUDIO_SECONDS), "{header:?}");
        });
    }
}

pub mod tensor_task {
    //! The `tensor` task's input, as the gateway converts it: the event's tensor as JSON, in OIP's
    //! JSON form (`data`, flat or nested) or as raw bytes in base64 (`data_b64`), one input or
    //! several by name, decoded by the worker protocol's own decoder under the task's
    //! `max_elements` and `datatype` (`tasks::tensor`), through the task's own plans
    //! ([`crate::tensor_converters`]).
    //!
    //! Checked: no refusal is `internal`; the probe's peak covers the tensors made; every tensor
    //! holds what its shape says and reaches the worker as it left
    //! ([`crate::check_calls`]).

    use super::fuzz;

    pub fn run(data: &[u8]) {
        fuzz::convert_with_every_row(fuzz::tensor_converters, data, |plan, converted| {
            let peak = plan.probe(data).expect("it converted");
            let held: usize = converted.calls.iter().flat_map(|call| &call.inputs).map(|t| t.data.byte_len()).sum();
            assert!(held as u64 <= peak, "{held} tensor bytes, a peak of {peak} reserved");
        });
    }
}

pub mod oip_request {
    //! An inference request body as the worker reads it (`oip::decode_request_in_place` with the
    //! default limits, as `server::infer` calls it), the binary tensor extension included, and the
    //! same bytes as the gateway reads a worker's answer (`oip::decode_response`).
    //!
    //! The input is `<Inference-Header-Content-Length>\n<body>`: the line before the first newline
    //! (within the first 24 bytes) is the header's value, read by `oip::parse_header_length`; an
    //! empty line, or none, stands for a request without the header (the whole body is JSON).
    //!
    //! Checked: every binary input's range lies in the body and holds exactly its shape's elements;
    //! every JSON input holds exactly its shape's values; the tensors, encoded again as the gateway
    //! encodes requests (binary, and JSON where every value is finite), decode to the same values.

    use super::fuzz;

    use vramgate_shared::oip::{self, DecodeLimits, RawData, Tensor, TensorData};

    /// Bytes the header line may take: `usize::MAX` has 20 digits.
    const MAX_HEADER_LINE: usize = 24;

    fn split(data: &[u8]) -> (Option<usize>, &[u8]) {
        match data.iter().take(MAX_HEADER_LINE).position(|&b| b == b'\n') {
            Some(0) => (None, &data[1..]),
            Some(n) => match oip::parse_header_length(&data[..n]) {
                Ok(len) => (Some(len), &data[n + 1..]),
                // The worker answers 400 to a header that is not a byte count; nothing to decode.
                Err(_) => (None, &[]),
            },
            None => (None, data),
        }
    }

    fn finite(data: &TensorData) -> bool {
        match data {
            TensorData::Fp16(v) => v.iter().all(|x| x.to_f32().is_finite()),
            TensorData::Fp32(v) => v.iter().all(|x| x.is_finite()),
            TensorData::Fp64(v) => v.iter().all(|x| x.is_finite()),
            _ => true,
        }
    }

    pub fn run(data: &[u8]) {
        let (header_len, body) = split(data);
        if body.is_empty() {
            return;
        }
        let _ = oip::decode_response(body, header_len);
        let Ok((request, raw)) = oip::decode_request_in_place(body, header_len, &DecodeLimits::default()) else { return };
        for output in request.outputs.iter().flatten() {
            oip::wants_binary_output(&request, &output.name);
        }
        for tensor in &raw {
            let elements = tensor.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).expect("a decoded shape does not overflow");
            match &tensor.data {
                RawData::Binary(range) => {
                    let size = tensor.datatype.element_size().expect("a binary tensor has a fixed element size");
                    assert!(range.end <= body.len(), "tensor {} at {range:?} of a {}-byte body", tensor.name, body.len());
                    assert_eq!(range.len(), elements * size, "tensor {}", tensor.name);
                }
                RawData::Json(values) => assert_eq!(values.len(), elements, "tensor {}", tensor.name),
            }
        }
        let (_, tensors) = oip::decode_request(body, header_len).expect("decode_request reads what decode_request_in_place read");
        let named = |t: &Tensor| (t.name.clone(), t.shape.clone(), t.datatype());
        assert!(raw.iter().map(|r| (r.name.clone(), r.shape.clone(), r.datatype)).eq(tensors.iter().map(named)));
        fuzz::check_wire_round_trip(&tensors);
        if tensors.iter().all(|t| finite(&t.data)) {
            let (json, header) = oip::encode_request(request.id.as_deref(), &tensors, false, &[]);
            assert_eq!(header, None, "a request of JSON data needs no header length");
            let (_, again) = oip::decode_request(&json, None).expect("a JSON request decodes");
            let values = |t: &Tensor| (named(t), fuzz::le_bytes(&t.data));
            assert!(tensors.iter().map(values).eq(again.iter().map(values)), "JSON data changed a value");
        }
    }
}

pub mod worker_config {
    //! The worker's configuration as it starts: every input is read twice through
    //! `WorkerConfig::load`, the function `main` calls, once as the worker's config file and once
    //! as a model folder's `config.toml` in a model repository (`config/repository.rs`: the folder
    //! is the model's name, beside a model file), so both TOML parsers, the layering, and every
    //! check of a model's inputs, outputs, batching, arguments and probe sizes see it. The files
    //! are written to a folder of this process's own ([`crate::scratch_dir`]); libtorch is
    //! linked (the crate's only library) but never called.
    //!
    //! Checked: what loads, validates again (`WorkerConfig::validate`), and a model from the
    //! repository keeps its folder's name.

    use super::fuzz;

    use std::path::PathBuf;
    use std::sync::OnceLock;

    use vramgate_worker::WorkerConfig;

    /// The model folder's name in the repository.
    const MODEL: &str = "fuzzed";

    struct Files {
        /// Where the input goes as the worker's config file.
        worker: PathBuf,
        /// Where the input goes as the model folder's `config.toml`.
        model: PathBuf,
        /// A worker config naming the repository.
        with_repository: PathBuf,
    }

    fn files() -> &'static Files {
        static FILES: OnceLock<Files> = OnceLock::new();
        FILES.get_or_init(|| {
            let dir = fuzz::scratch_dir("worker-config");
            let folder = dir.join("repository").join(MODEL);
            std::fs::create_dir_all(&folder).expect("the model folder can be made");
            std::fs::write(folder.join("model.pt"), b"").expect("the model file can be written");
            let with_repository = dir.join("with-repository.toml");
            let repository = dir.join("repository");
            std::fs::write(&with_repository, format!("model_repository = {:?}\n", repository.display().to_string()))
                .expect("the worker config can be written");
            Files { worker: dir.join("worker.toml"), model: folder.join("config.toml"), with_repository }
        })
    }

    pub fn run(data: &[u8]) {
        let files = files();
        std::fs::write(&files.worker, data).expect("the fuzzed worker config can be written");
        if let Ok(config) = WorkerConfig::load(Some(&files.worker)) {
            config.validate().expect("a loaded config validates");
        }
        std::fs::write(&files.model, data).expect("the fuzzed model config can be written");
        if let Ok(config) = WorkerConfig::load(Some(&files.with_repository)) {
            config.validate().expect("a loaded config validates");
            let model = config.models.last().expect("the repository's one model is loaded");
            assert_eq!(model.name, MODEL);
        }
    }
}

pub mod video {
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

    use std::sync::OnceLock;

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

    pub fn run(data: &[u8]) {
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
    }
}
