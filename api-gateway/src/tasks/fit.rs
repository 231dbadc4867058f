//! Whether a task fits its models, from what the worker declares of them (OIP model metadata,
//! `GET /v2/models/{name}`): the tensors the task's converter sends (how many, their names,
//! datatype, rank and the sizes it fixes) and the outputs it asks for (each declared, each of a
//! datatype its `[[outputs]]` row's post steps take). Pure: [`crate::model_check`] asks the
//! workers and decides what a misfit does (stops the gateway).
//!
//! A task says what it sends and asks per model through [`super::Converter::uses`]; only what
//! it knows from its configuration is compared (the `tensor` converter's shapes come with each
//! event, so only its names, and its datatype when `tensor.datatype` names one).
//!
//! What would fail every event is a misfit: another count of inputs, a name a model of several
//! inputs does not declare, another datatype or rank, a fixed size the model fixes otherwise,
//! an output the model does not declare, a post step its datatype does not take. What works is
//! a warning: a model of one input called by another name (the worker takes a lone tensor
//! whatever its name). A size the converter leaves open where the model fixes one is not
//! compared (some inputs fit).

use vramgate_shared::oip::{DataType, ModelMetadata, TensorMetadata};


/// What a task sends one of its models and asks of it.
#[derive(Debug, Clone)]
pub struct ModelUse {
    pub inputs: Sent,
    pub outputs: Vec<Asked>,
}

/// The tensors a converter sends.
#[derive(Debug, Clone)]
pub enum Sent {
    /// One tensor (the worker takes it whatever its name for a model of one input).
    One(SentTensor),
    /// Several, each by name (the `tensor` converter's `inputs`): the model's inputs, all.
    Named { key: String, tensors: Vec<SentTensor> },
}

/// One tensor a converter sends, as far as its configuration fixes it.
#[derive(Debug, Clone)]
pub struct SentTensor {
    /// Where it is configured, for messages: `image.input = "image"`.
    pub key: String,
    pub name: String,
    /// `None`: whatever the event holds.
    pub datatype: Option<DataType>,
    /// `None`: whatever the event holds.
    pub shape: Option<Vec<Dim>>,
}

/// One dimension of a tensor a converter makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    Fixed(usize),
    /// Set by each input (samples, frames, candidates).
    Any,
}

/// One output a task asks for.
#[derive(Debug, Clone)]
pub struct Asked {
    /// Where it is asked for, for messages: `[[outputs]] row 2 (name = "length")`.
    pub by: String,
    pub name: String,
    pub takes: Takes,
}

/// The datatypes an asked-for output may have.
#[derive(Debug, Clone)]
pub enum Takes {
    /// What its row's steps make of each datatype: `Ok` where they take it, else why not
    /// (the row works this out, `super::outputs::asked`, so that this module need not know
    /// the steps).
    Steps(Vec<(DataType, Result<(), String>)>),
    /// Floating point: a built-in task's probabilities and coordinates.
    Floats,
}

impl Takes {
    fn fits(&self, datatype: DataType) -> Result<(), String> {
        match self {
            Takes::Steps(table) => table
                .iter()
                .find(|(d, _)| *d == datatype)
                .map(|(_, fits)| fits.clone())
                .unwrap_or_else(|| Err(format!("{} is a datatype the gateway does not read", datatype.as_str()))),
            Takes::Floats if matches!(datatype, DataType::Fp16 | DataType::Fp32) => Ok(()),
            Takes::Floats => Err("this task reads it as probabilities or coordinates: it needs a floating-point output (FP16, FP32)".into()),
        }
    }
}

impl SentTensor {
    pub fn new(key: &str, name: &str, datatype: Option<DataType>, shape: Option<Vec<Dim>>) -> Self {
        SentTensor { key: format!("{key} = {name:?}"), name: name.to_string(), datatype, shape }
    }
}

impl Asked {
    /// An output a built-in task reads as probabilities or coordinates (floating point).
    pub fn floats(converter: &str, name: &str) -> Asked {
        Asked { by: format!("(converter {converter:?}) output {name:?}"), name: name.to_string(), takes: Takes::Floats }
    }
}

impl ModelUse {
    /// A built-in task's use of a model: one FP32 tensor named `input` of `shape`, and
    /// floating-point `outputs`.
    pub fn built_in(converter: &str, input: &str, shape: Vec<Dim>, outputs: &[&str]) -> ModelUse {
        let key = format!("(converter {converter:?}) input");
        ModelUse {
            inputs: Sent::One(SentTensor::new(&key, input, Some(DataType::Fp32), Some(shape))),
            outputs: outputs.iter().map(|name| Asked::floats(converter, name)).collect(),
        }
    }
}

/// What one model's metadata says of a task's use of it.
#[derive(Debug, Default, PartialEq)]
pub struct Verdict {
    /// Each a whole message: `task 'x' …: …; model 'm' declares …`.
    pub misfits: Vec<String>,
    pub warnings: Vec<String>,
}

/// Compares `task`'s use of a model with the model's metadata.
pub fn check(task: &str, used: &ModelUse, model: &ModelMetadata) -> Verdict {
    let mut verdict = Verdict::default();
    let name = &model.name;
    match &used.inputs {
        Sent::One(sent) => match &model.inputs[..] {
            [declared] => {
                if let Some(why) = tensor_misfit(sent, declared) {
                    verdict.misfits.push(format!("task '{task}' {}: {why}; model '{name}' declares {}", sent.key, show(declared)));
                }
                if sent.name != declared.name {
                    verdict.warnings.push(format!(
                        "task '{task}' {}: model '{name}' calls its input '{}' (a model of one input takes its tensor \
                         by any name)",
                        sent.key, declared.name
                    ));
                }
            }
            declared => verdict.misfits.push(format!(
                "task '{task}' {}: sends one tensor; model '{name}' declares {} inputs: {}",
                sent.key,
                declared.len(),
                show_all(declared)
            )),
        },
        Sent::Named { key, tensors } => {
            for sent in tensors {
                match model.inputs.iter().find(|d| d.name == sent.name) {
                    Some(declared) => {
                        if let Some(why) = tensor_misfit(sent, declared) {
                            verdict.misfits.push(format!("task '{task}' {key}, '{}': {why}; model '{name}' declares {}", sent.name, show(declared)));
                        }
                    }
                    None => verdict.misfits.push(format!(
                        "task '{task}' {key}: model '{name}' has no input '{}'; it declares {}",
                        sent.name,
                        show_all(&model.inputs)
                    )),
                }
            }
            for declared in model.inputs.iter().filter(|d| !tensors.iter().any(|s| s.name == d.name)) {
                verdict.misfits.push(format!(
                    "task '{task}' {key}: does not send '{}', which model '{name}' declares ({})",
                    declared.name,
                    show(declared)
                ));
            }
        }
    }
    for asked in &used.outputs {
        let Some(declared) = model.outputs.iter().find(|d| d.name == asked.name) else {
            verdict.misfits.push(format!(
                "task '{task}' {}: model '{name}' has no output '{}'; it declares {}",
                asked.by,
                asked.name,
                show_all(&model.outputs)
            ));
            continue;
        };
        let fits = match declared.datatype.parse::<DataType>() {
            Ok(datatype) => asked.takes.fits(datatype),
            Err(_) => Err(format!("{:?} is no datatype", declared.datatype)),
        };
        if let Err(why) = fits {
            verdict.misfits.push(format!("task '{task}' {}: {why}; model '{name}' declares {}", asked.by, show(declared)));
        }
    }
    verdict
}

/// Why a sent tensor does not fit the declared one, if it does not (the name aside).
fn tensor_misfit(sent: &SentTensor, declared: &TensorMetadata) -> Option<String> {
    let shown = |sent: &SentTensor| {
        let datatype = sent.datatype.map_or("any datatype", DataType::as_str);
        match &sent.shape {
            Some(shape) => format!("{datatype} {}", show_dims(shape)),
            None => datatype.to_string(),
        }
    };
    if let Some(datatype) = sent.datatype {
        if datatype.as_str() != declared.datatype {
            return Some(format!("sends {}", shown(sent)));
        }
    }
    let shape = sent.shape.as_ref()?;
    let fixed_apart = shape.iter().zip(&declared.shape).any(|(sent, &declared)| match sent {
        Dim::Fixed(size) => declared >= 0 && i64::try_from(*size).ok() != Some(declared),
        Dim::Any => false,
    });
    (shape.len() != declared.shape.len() || fixed_apart).then(|| format!("sends {}", shown(sent)))
}

/// `[1, 224, 224, 3]`, a size set by each input as `-1` (as the model's metadata writes it).
fn show_dims(shape: &[Dim]) -> String {
    let dims: Vec<String> = shape
        .iter()
        .map(|d| match d {
            Dim::Fixed(size) => size.to_string(),
            Dim::Any => "-1".into(),
        })
        .collect();
    format!("[{}]", dims.join(", "))
}

/// `length INT64 [-1]`.
fn show(t: &TensorMetadata) -> String {
    format!("{} {} {:?}", t.name, t.datatype, t.shape)
}

fn show_all(tensors: &[TensorMetadata]) -> String {
    if tensors.is_empty() {
        return "none".into();
    }
    tensors.iter().map(show).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::outputs::{asked, OutputRule};

    fn meta(inputs: &[(&str, &str, &[i64])], outputs: &[(&str, &str, &[i64])]) -> ModelMetadata {
        let tensors = |list: &[(&str, &str, &[i64])]| {
            list.iter().map(|(n, d, s)| TensorMetadata { name: n.to_string(), datatype: d.to_string(), shape: s.to_vec() }).collect()
        };
        ModelMetadata { name: "m".into(), inputs: tensors(inputs), outputs: tensors(outputs), ..ModelMetadata::default() }
    }

    fn rule(json: &str) -> OutputRule {
        serde_json::from_str(json).expect("rule parses")
    }

    /// `used` against `model`: each expected misfit and warning a part of one message, in order.
    fn check_use(used: &ModelUse, model: &ModelMetadata, misfits: &[&str], warnings: &[&str]) {
        let verdict = check("t", used, model);
        let matches = |got: &[String], want: &[&str]| got.len() == want.len() && got.iter().zip(want).all(|(g, w)| g.contains(w));
        assert!(matches(&verdict.misfits, misfits), "misfits {:#?}, expected {misfits:#?}", verdict.misfits);
        assert!(matches(&verdict.warnings, warnings), "warnings {:#?}, expected {warnings:#?}", verdict.warnings);
    }

    fn image_use(datatype: DataType, shape: &[usize], rows: &[OutputRule]) -> ModelUse {
        let shape = Some(shape.iter().map(|&s| Dim::Fixed(s)).collect());
        ModelUse { inputs: Sent::One(SentTensor::new("image.input", "image", Some(datatype), shape)), outputs: asked(rows) }
    }

    #[test]
    fn outputs_must_be_declared_and_of_a_datatype_their_steps_take() {
        let model = meta(&[("tokens", "INT64", &[-1, -1])], &[("length", "INT64", &[-1]), ("embedding", "FP32", &[-1, 768])]);
        let tokens = |rows: &[OutputRule]| ModelUse {
            inputs: Sent::One(SentTensor::new("tensor.input", "tokens", Some(DataType::Int64), None)),
            outputs: asked(rows),
        };
        check_use(&tokens(&[rule(r#"{"name": "length"}"#), rule(r#"{"name": "embedding", "post": ["softmax"]}"#)]), &model, &[], &[]);
        check_use(
            &tokens(&[rule(r#"{"name": "embedding"}"#), rule(r#"{"name": "length", "post": ["softmax"]}"#), rule(r#"{"name": "nope"}"#)]),
            &model,
            &[
                "task 't' [[outputs]] row 2 (name = \"length\", post = [\"softmax\"]): softmax needs a floating-point output \
                 (FP16, FP32); model 'm' declares length INT64 [-1]",
                "task 't' [[outputs]] row 3 (name = \"nope\"): model 'm' has no output 'nope'; it declares length INT64 [-1], \
                 embedding FP32 [-1, 768]",
            ],
            &[],
        );
        check_use(&tokens(&[rule(r#"{"name": "length", "post": ["argmax"]}"#)]), &model, &[], &[]);
        let bools = meta(&[("tokens", "INT64", &[-1, -1])], &[("mask", "BOOL", &[-1, -1]), ("wide", "UINT64", &[-1])]);
        check_use(
            &tokens(&[rule(r#"{"name": "mask", "post": ["threshold"]}"#), rule(r#"{"name": "wide"}"#)]),
            &bools,
            &["row 1 (name = \"mask\", post = [\"threshold\"]): threshold needs a numeric output", "row 2 (name = \"wide\"): UINT64 is a datatype the gateway does not read"],
            &[],
        );
        // A face_boxes row asks for its regressions too.
        let maps = meta(&[("image", "FP32", &[-1, 3, -1, -1])], &[("face_prob", "FP32", &[-1, 2, -1, -1])]);
        let boxes = rule(r#"{"name": "face_prob", "post": ["face_boxes"], "boxes": "box_offsets"}"#);
        check_use(
            &image_use(DataType::Fp32, &[1, 3, 320, 320], &[boxes]),
            &maps,
            &["row 1 (name = \"face_prob\", post = [\"face_boxes\"], boxes = \"box_offsets\"): model 'm' has no output 'box_offsets'"],
            &[],
        );
    }

    #[test]
    fn the_converters_tensor_must_be_the_declared_one() {
        let logits = [rule(r#"{"name": "logits"}"#)];
        let classifier = meta(&[("image", "UINT8", &[-1, 224, 224, 3])], &[("logits", "FP32", &[-1, 1000])]);
        check_use(&image_use(DataType::Uint8, &[1, 224, 224, 3], &logits), &classifier, &[], &[]);
        let sends = |datatype, shape: &[usize], want: &str| {
            check_use(&image_use(datatype, shape, &logits), &classifier, &[want], &[]);
        };
        sends(DataType::Fp32, &[1, 224, 224, 3], "task 't' image.input = \"image\": sends FP32 [1, 224, 224, 3]; model 'm' declares image UINT8 [-1, 224, 224, 3]");
        sends(DataType::Uint8, &[1, 3, 224, 224], "sends UINT8 [1, 3, 224, 224]; model 'm' declares image UINT8 [-1, 224, 224, 3]");
        sends(DataType::Uint8, &[224, 224, 3], "sends UINT8 [224, 224, 3]");
        // A size the converter leaves open is not compared; a model of no batch dimension
        // declares its whole shape.
        let audio = |shape: Vec<Dim>| ModelUse {
            inputs: Sent::One(SentTensor::new("audio.input", "audio", Some(DataType::Fp32), Some(shape))),
            outputs: vec![],
        };
        let clip = meta(&[("audio", "FP32", &[-1])], &[]);
        check_use(&audio(vec![Dim::Any]), &clip, &[], &[]);
        check_use(&audio(vec![Dim::Fixed(1), Dim::Any]), &clip, &["audio.input = \"audio\": sends FP32 [1, -1]; model 'm' declares audio FP32 [-1]"], &[]);
        check_use(&audio(vec![Dim::Any, Dim::Fixed(1024)]), &meta(&[("frames", "FP32", &[-1, 1024])], &[]), &[], &["model 'm' calls its input 'frames'"]);
        check_use(&audio(vec![Dim::Any, Dim::Fixed(512)]), &meta(&[("audio", "FP32", &[-1, 1024])], &[]), &["sends FP32 [-1, 512]"], &[]);
    }

    #[test]
    fn several_inputs_are_matched_by_name() {
        let stream = meta(&[("chunk", "FP32", &[-1, 576]), ("state", "FP32", &[-1, 2, 128])], &[]);
        let named = |names: &[&str]| ModelUse {
            inputs: Sent::Named {
                key: format!("tensor.inputs = {names:?}"),
                tensors: names.iter().map(|n| SentTensor::new("tensor.inputs", n, Some(DataType::Fp32), None)).collect(),
            },
            outputs: vec![],
        };
        check_use(&named(&["state", "chunk"]), &stream, &[], &[]);
        check_use(
            &named(&["chunk", "mask"]),
            &stream,
            &[
                "task 't' tensor.inputs = [\"chunk\", \"mask\"]: model 'm' has no input 'mask'; it declares chunk FP32 [-1, 576], state FP32 [-1, 2, 128]",
                "does not send 'state', which model 'm' declares (state FP32 [-1, 2, 128])",
            ],
            &[],
        );
        let one = ModelUse { inputs: Sent::One(SentTensor::new("tensor.input", "input", None, None)), outputs: vec![] };
        check_use(&one, &stream, &["task 't' tensor.input = \"input\": sends one tensor; model 'm' declares 2 inputs: chunk"], &[]);
        let ints = meta(&[("chunk", "INT64", &[-1, 576]), ("state", "FP32", &[-1, 2, 128])], &[]);
        check_use(&named(&["chunk", "state"]), &ints, &["'chunk': sends FP32; model 'm' declares chunk INT64 [-1, 576]"], &[]);
    }
}
