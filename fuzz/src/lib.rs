//! Each fuzz target's body ([`targets`]) and what the bodies share: the gateway's converters as
//! task table rows would build them, a plan run the way `record` runs it (the header probe, then
//! the conversion), and the checks every conversion's output must pass whatever its input.
//! Nothing here parses: the bodies call the services' own parsers.
//!
//! `fuzz_targets/` hands each body to libFuzzer. Nothing here uses libfuzzer-sys, so the
//! services' test suite includes this file as a module and runs every committed seed through
//! the same bodies (`tests/tests/fuzz_seeds.rs`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde::de::DeserializeOwned;
use serde_json::json;
use vramgate_gateway::tasks::audio::{AudioInput, AudioOptions};
use vramgate_gateway::tasks::image::{ImageOptions, ImageTask};
use vramgate_gateway::tasks::image_model::ImageInput;
use vramgate_gateway::tasks::outputs::{ConfiguredTask, InputConverter, OutputRule, Outputs};
use vramgate_gateway::tasks::tensor::{TensorInput, TensorOptions};
use vramgate_gateway::tasks::{Converted, Converter, Plan};
use vramgate_shared::events::ErrorKind;
use vramgate_shared::oip::{self, Tensor, TensorData};

pub mod targets;

/// The largest peak a plan's probe may announce for the fuzzer to go on and convert. The
/// gateway reserves whatever the probe says (a record larger than its whole budget runs
/// alone); the fuzzer stops short of that, so that an input that is large by right does not
/// trip libFuzzer's RSS limit (2 GiB in `scripts/fuzz`, which AddressSanitizer's shadow and
/// quarantine share). A conversion that holds far more than its probe announced still does.
pub const MAX_PEAK_BYTES: u64 = 256 << 20;

/// The most pixels an image's header may declare, as a task row's `image.max_pixels` (the
/// gateway's default is 40 M): larger images are refused from their header, as in service,
/// and the fuzzer spends its time on decoding rather than on a few huge images.
pub const MAX_PIXELS: u64 = 4_000_000;

/// The longest audio taken, as a task row's `max_audio_seconds` (the default is 600 s), for the
/// same reason.
pub const MAX_AUDIO_SECONDS: f64 = 10.0;

/// Lets a panic raised inside symphonia unwind to the gateway's own guard around it
/// (`audio::decode` runs every symphonia call in `catch_unwind` and refuses the input as a
/// codec error), as it does in service, where overflow checks stay on in symphonia's crates
/// (the workspace's release profile). libfuzzer-sys's hook aborts on every panic, caught or
/// not, which would stop the fuzzer at the first such input instead of at a real finding. Any
/// other panic still aborts through that hook, and one from symphonia that escaped the guard
/// would still abort in libfuzzer-sys's own `catch_unwind` around the target.
pub fn let_symphonia_panics_reach_the_guard() {
    let abort = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.location().is_some_and(|at| at.file().contains("/symphonia-")) {
            return;
        }
        abort(info)
    }));
}

/// Runs `plan` on `bytes` as `record` does: the header probe, then, when it passes (and
/// announces at most [`MAX_PEAK_BYTES`]), the conversion, whose calls are checked with
/// [`check_calls`]. A refusal is the input's fault and ends the record as a dead letter, so it
/// is no finding unless it is `internal` (a bug, by that kind's definition); a panic, an abort
/// or a failed check is.
pub fn probe_then_convert(plan: &dyn Plan, bytes: &[u8]) -> Option<Converted> {
    let peak = match plan.probe(bytes) {
        Ok(peak) => peak,
        Err(failure) => {
            assert_ne!(failure.kind, ErrorKind::Internal, "probe: {}", failure.message);
            return None;
        }
    };
    if peak > MAX_PEAK_BYTES {
        return None;
    }
    match plan.convert(bytes) {
        Ok(converted) => {
            check_calls(&converted);
            Some(converted)
        }
        Err(failure) => {
            assert_ne!(failure.kind, ErrorKind::Internal, "convert: {}", failure.message);
            None
        }
    }
}

/// Every tensor of every call holds as many values as its shape says, and reaches the worker
/// as it left the gateway ([`check_wire_round_trip`]).
pub fn check_calls(converted: &Converted) {
    for call in &converted.calls {
        for tensor in &call.inputs {
            assert_eq!(tensor.element_count(), tensor.data.len(), "tensor {} of shape {:?}", tensor.name, tensor.shape);
        }
        check_wire_round_trip(&call.inputs);
    }
}

/// Encodes `tensors` as the gateway sends them over HTTP (`call::client::InferCall`: every input
/// in the binary extension) and decodes the body as the worker does (`decode_request_in_place`,
/// its default limits): the same tensors come back, bit for bit.
pub fn check_wire_round_trip(tensors: &[Tensor]) {
    let (body, header_len) = oip::encode_request(Some("fuzz"), tensors, true, &[]);
    let (_, decoded) = oip::decode_request(&body, header_len).expect("the worker decodes what the gateway encodes");
    assert_eq!(decoded.len(), tensors.len());
    for (sent, read) in tensors.iter().zip(&decoded) {
        assert_eq!((&sent.name, &sent.shape, sent.datatype()), (&read.name, &read.shape, read.datatype()));
        assert!(le_bytes(&sent.data) == le_bytes(&read.data), "tensor {} changed on the wire", sent.name);
    }
}

/// The values as the binary extension carries them (so NaNs compare by their bits).
pub fn le_bytes(data: &TensorData) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.byte_len());
    data.write_le_bytes(&mut out);
    out
}

/// Every float value of the calls is finite: what decoders make of pixels and samples must be
/// (the worker refuses NaN and infinity).
pub fn check_finite(converted: &Converted) {
    for tensor in converted.calls.iter().flat_map(|call| &call.inputs) {
        let finite = match &tensor.data {
            TensorData::Fp32(v) => v.iter().all(|x| x.is_finite()),
            TensorData::Fp16(v) => v.iter().all(|x| x.to_f32().is_finite()),
            TensorData::Fp64(v) => v.iter().all(|x| x.is_finite()),
            _ => true,
        };
        assert!(finite, "tensor {} holds a value that is not finite", tensor.name);
    }
}

/// A converter's options from the keys a task row sets over its defaults, checked by `validate`
/// as the gateway's config check does; panics on a row it would refuse (a harness mistake, not a
/// finding).
pub fn options<T: DeserializeOwned>(keys: serde_json::Value, validate: impl Fn(&T) -> Result<(), String>) -> T {
    let options: T = serde_json::from_value(keys).expect("the fuzz target's task row parses");
    validate(&options).expect("the fuzz target's task row is valid");
    options
}

/// A configured converter's task row, with one `[[outputs]]` row: the outputs are not what
/// the fuzzer reads, the conversion is.
pub fn configured(input: impl InputConverter + 'static) -> Box<dyn Converter> {
    let rule: OutputRule = options(json!({"name": "output"}), |_| Ok(()));
    Box::new(ConfiguredTask::new(input, Outputs::load(&[rule], 100).expect("one output row loads")))
}

/// The image task rows the `image` target converts every input with: MTCNN's cascade (the
/// whole image decoded, its pyramid), P-Net proposals letterboxed and stretched, and any image
/// model's tensor (torchvision's resize and centre crop, a letterbox in NHWC UINT8 BGR without
/// a batch dimension, a stretch to FP16 with a mean and std). All take [`MAX_PIXELS`].
pub fn image_converters() -> Vec<Box<dyn Converter>> {
    let image = |mut keys: serde_json::Value| {
        keys["max_pixels"] = json!(MAX_PIXELS);
        options(keys, ImageOptions::validate)
    };
    let model = |keys| configured(ImageInput { options: image(keys) });
    vec![
        Box::new(ImageTask::new(image(json!({"mode": "faces"})))),
        Box::new(ImageTask::new(image(json!({"mode": "proposals", "width": 96, "height": 64})))),
        Box::new(ImageTask::new(image(json!({"mode": "proposals", "width": 48, "height": 80, "resize": "stretch"})))),
        model(json!({"mode": "tensor", "width": 64, "height": 64, "resize": "shorter_side_crop", "shorter_side": 72,
            "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]})),
        model(json!({"mode": "tensor", "width": 40, "height": 56, "layout": "nhwc", "channel_order": "bgr",
            "datatype": "UINT8", "batch": false, "fill": 114})),
        model(json!({"mode": "tensor", "width": 33, "height": 17, "resize": "stretch", "datatype": "FP16",
            "scale": 0.5, "mean": [1, 2, 3], "std": [4, 5, 6]})),
    ]
}

/// The `audio` task rows the `compressed_audio` target converts every input with: the whole
/// signal at 16 kHz, and torchcrepe's centred frames at 16 kHz in FP16 without a batch
/// dimension. Both take [`MAX_AUDIO_SECONDS`].
pub fn audio_converters() -> Vec<Box<dyn Converter>> {
    let audio = |mut keys: serde_json::Value| {
        keys["max_audio_seconds"] = json!(MAX_AUDIO_SECONDS);
        configured(AudioInput { options: options(keys, AudioOptions::validate) })
    };
    vec![audio(json!({})), audio(json!({"frames": {"size": 1024, "hop": 160, "center": true}, "datatype": "FP16", "batch": false}))]
}

/// The `tensor` task rows the `tensor_task` target converts every input with: one input of
/// any datatype, one that takes FP32 only, and a model of two inputs by name.
pub fn tensor_converters() -> Vec<Box<dyn Converter>> {
    let tensor = |keys| configured(TensorInput { options: options(keys, TensorOptions::validate) });
    vec![tensor(json!({})), tensor(json!({"datatype": "FP32", "max_elements": 4096})), tensor(json!({"inputs": ["chunk", "state"]}))]
}

/// Runs every task row of `converters` on `bytes` as a request without options
/// ([`probe_then_convert`]), and `check` on each conversion that succeeds. Each set of rows is
/// planned once, on its first call, and kept under the address of the function that lists it:
/// a fuzz target converts with one set, the seed test with each target's in turn.
pub fn convert_with_every_row(converters: fn() -> Vec<Box<dyn Converter>>, bytes: &[u8], check: impl Fn(&dyn Plan, &Converted)) {
    type Planned = (usize, Arc<Vec<Arc<dyn Plan>>>);
    static PLANS: Mutex<Vec<Planned>> = Mutex::new(Vec::new());
    let key = converters as usize;
    let plans = {
        let mut planned = PLANS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match planned.iter().find(|(k, _)| *k == key) {
            Some((_, plans)) => Arc::clone(plans),
            None => {
                let plans: Vec<Arc<dyn Plan>> =
                    converters().iter().map(|c| c.plan(None).expect("a task row plans a request without options")).collect();
                let plans = Arc::new(plans);
                planned.push((key, Arc::clone(&plans)));
                plans
            }
        }
    };
    for plan in plans.iter() {
        if let Some(converted) = probe_then_convert(&**plan, bytes) {
            check(&**plan, &converted);
        }
    }
}

/// Where [`scratch_dir`] puts `name`'s folder for this process (nothing is created).
pub fn scratch_path(name: &str) -> PathBuf {
    let base = std::env::var_os("VRAMGATE_FUZZ_SCRATCH").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    base.join(format!("vramgate-fuzz-{name}-{}", std::process::id()))
}

/// A folder of this process's own for a target's files, created empty: under
/// `$VRAMGATE_FUZZ_SCRATCH` when it is set (`scripts/fuzz` sets it, and removes it after each
/// run), else under the system's temporary folder.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = scratch_path(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("the fuzz scratch folder can be created");
    dir
}
