//! MTCNN's cascade as a chain of worker calls (`mode = "faces"`): the image decoded once, its
//! pyramid's levels sent to P-Net (stage 0: the task's `model`), the survivors' crops to R-Net
//! (stage 1: `refine_model`) and theirs to O-Net (stage 2: `output_model`). Each stage's calls
//! are made together; what happens between them (see [`super::mtcnn`]) is CPU work, so every
//! [`Finish`] here runs on the task's rayon pool, and each keeps the decoded image, counted in
//! the record's held bytes, until the last stage has cut its crops.
//!
//! **Levels as separate calls.** Each pyramid level is one request of its own size, sent at
//! once with the others (each through the P-Net workers' permits and byte admission). Padding
//! the levels to one batch is not an option: P-Net's ceil-mode pooling sees the padding at a
//! smaller level's edge, so the padded answer differs from facenet-pytorch's at every level but
//! the largest, and the batch would cost the largest level's memory times the level count
//! instead of the pyramid's sum (about twice the first level, at factor 0.709).
//!
//! **Candidates as batched calls.** A stage's candidates are one request (`[n, 3, 24, 24]` or
//! `[n, 3, 48, 48]`), or several of `max_batch_rows` each when there are more; more than
//! `max_candidates` dead-letters the image, naming the stage.

use ::image::RgbImage;
use vramgate_shared::events::{ErrorKind, FaceBox, ImageOutput, Stage};
use vramgate_shared::oip::{Tensor, TensorData};

use super::mtcnn::{self, Candidate, Crop, Face, StageAnswer, ONET_SIDE, RNET_SIDE};
use super::{decode_bytes, decode_rgb, probe, ImageOptions, BOX_OUTPUT, MODEL_INPUT, PROB_OUTPUT};
use crate::call::client::OutputTensor;
use crate::failure::Failure;
use crate::tasks::{Converted, Finish, ModelCall, Plan, Step};

/// O-Net's output: `[n, 10]`, the five landmarks' x then y, relative to the box.
pub const LANDMARKS_OUTPUT: &str = "landmarks";

/// R-Net's and O-Net's outputs, in the order their finishes read them. `face_prob` is `[n, 2]`
/// there (no-face, face), `box_offsets` `[n, 4]`.
const RNET_OUTPUTS: &[&str] = &[BOX_OUTPUT, PROB_OUTPUT];
const ONET_OUTPUTS: &[&str] = &[BOX_OUTPUT, LANDMARKS_OUTPUT, PROB_OUTPUT];

pub struct CascadePlan {
    options: ImageOptions,
}

impl CascadePlan {
    pub fn new(options: ImageOptions) -> Self {
        CascadePlan { options }
    }
}

impl Plan for CascadePlan {
    /// The decode's peak, or the decoded image beside every level's tensor, whichever is more.
    /// A quarter turn swaps the sides, which leaves the pyramid's sizes as they are.
    fn probe(&self, bytes: &[u8]) -> Result<u64, Failure> {
        let header = probe(bytes, self.options.max_pixels)?;
        let pyramid: u64 = mtcnn::scales(header.width, header.height, self.options.min_face_size, self.options.factor)
            .into_iter()
            .map(|s| {
                let (w, h) = mtcnn::level_size(header.width, header.height, s);
                (w as u64).saturating_mul(h as u64).saturating_mul(3 * 4)
            })
            .sum();
        Ok(decode_bytes(&header).max(header.pixels().saturating_mul(3).saturating_add(pyramid)))
    }

    fn convert(&self, bytes: &[u8]) -> Result<Converted, Failure> {
        let (image, format) = decode_rgb(bytes, self.options.max_pixels)?;
        let scales = mtcnn::scales(image.width(), image.height(), self.options.min_face_size, self.options.factor);
        let calls = scales
            .iter()
            .map(|&scale| {
                let (w, h) = mtcnn::level_size(image.width(), image.height(), scale);
                let mut data = Vec::with_capacity(3 * w * h);
                mtcnn::resample(&image, Crop::whole(&image), w, h, &mut data);
                let tensor = Tensor { name: MODEL_INPUT.into(), shape: vec![1, 3, h, w], data: TensorData::Fp32(data) };
                ModelCall { stage: 0, inputs: vec![tensor], outputs: &[PROB_OUTPUT, BOX_OUTPUT], name: None }
            })
            .collect();
        let finish = Pyramid { image: Photo { image, format }, scales, options: self.options.clone() };
        Ok(Converted { calls, finish: Box::new(finish) })
    }
}

/// The decoded image the stages crop from, and its format for the result.
struct Photo {
    image: RgbImage,
    format: &'static str,
}

impl Photo {
    fn bytes(&self) -> u64 {
        self.image.as_raw().len() as u64
    }

    fn result(&self, mut faces: Vec<Face>, max_faces: usize) -> Step {
        faces.sort_by(|a, b| b.score.total_cmp(&a.score));
        faces.truncate(max_faces);
        let round = |v: f32| (v * 100.0).round() / 100.0;
        let faces = faces
            .into_iter()
            .map(|f| FaceBox {
                x1: round(f.x1),
                y1: round(f.y1),
                x2: round(f.x2),
                y2: round(f.y2),
                score: (f.score * 1e6).round() / 1e6,
                landmarks: Some(f.landmarks.map(|[x, y]| [round(x), round(y)])),
            })
            .collect();
        let output = ImageOutput {
            faces,
            width: self.image.width(),
            height: self.image.height(),
            format: self.format.to_string(),
        };
        Step::Done(serde_json::to_value(output).expect("image outputs always serialise"))
    }
}

/// After P-Net: every level's maps, in the order of `scales`.
struct Pyramid {
    image: Photo,
    scales: Vec<f64>,
    options: ImageOptions,
}

impl Finish for Pyramid {
    fn output(self: Box<Self>, answers: Vec<Vec<OutputTensor>>) -> Result<Step, Failure> {
        if answers.len() != self.scales.len() {
            return Err(internal(format!("{} answers for {} pyramid levels", answers.len(), self.scales.len())));
        }
        let mut proposals = Vec::new();
        for (answer, &scale) in answers.iter().zip(&self.scales) {
            let [prob, offsets] = &answer[..] else {
                return Err(internal(format!("P-Net answered {} outputs; it gives two", answer.len())));
            };
            proposals.extend(mtcnn::proposals(&prob.floats()?, &prob.shape, &offsets.floats()?, scale, self.options.thresholds[0])?);
        }
        let candidates = mtcnn::refine_proposals(proposals);
        next_stage(self.image, candidates, Next::Refine, self.options)
    }

    fn cpu_bound(&self) -> bool {
        true
    }

    fn held_bytes(&self) -> u64 {
        self.image.bytes()
    }
}

/// Which network the crops go to next.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Next {
    Refine,
    Output,
}

impl Next {
    fn stage(self) -> usize {
        match self {
            Next::Refine => 1,
            Next::Output => 2,
        }
    }

    fn network(self) -> &'static str {
        match self {
            Next::Refine => "R-Net",
            Next::Output => "O-Net",
        }
    }
}

/// Crops `candidates` from the image for the next network, as batched calls; no call (and no
/// face) when none is left.
fn next_stage(image: Photo, candidates: Vec<Candidate>, next: Next, options: ImageOptions) -> Result<Step, Failure> {
    let (width, height) = (image.image.width(), image.image.height());
    let (candidates, crops): (Vec<Candidate>, Vec<Crop>) =
        candidates.into_iter().filter_map(|c| Crop::of(&c, width, height).map(|crop| (c, crop))).unzip();
    if candidates.is_empty() {
        return Ok(image.result(Vec::new(), options.max_faces));
    }
    if candidates.len() > options.max_candidates {
        return Err(Failure::new(
            ErrorKind::InputTooLarge,
            Stage::Infer,
            format!(
                "{} candidates for {} (stage {} of 3), more than image.max_candidates ({}); \
                 raise min_face_size or the thresholds for this image",
                candidates.len(),
                next.network(),
                next.stage() + 1,
                options.max_candidates
            ),
        ));
    }
    let (side, outputs) = match next {
        Next::Refine => (RNET_SIDE, RNET_OUTPUTS),
        Next::Output => (ONET_SIDE, ONET_OUTPUTS),
    };
    let calls = crops
        .chunks(options.max_batch_rows.max(1))
        .map(|chunk| {
            let mut data = Vec::with_capacity(chunk.len() * 3 * side * side);
            for &crop in chunk {
                mtcnn::resample(&image.image, crop, side, side, &mut data);
            }
            let tensor =
                Tensor { name: MODEL_INPUT.into(), shape: vec![chunk.len(), 3, side, side], data: TensorData::Fp32(data) };
            ModelCall { stage: next.stage(), inputs: vec![tensor], outputs, name: None }
        })
        .collect();
    let finish = Candidates { image, candidates, next, options };
    Ok(Step::Next(Converted { calls, finish: Box::new(finish) }))
}

/// After R-Net or O-Net: the candidates sent, in order, and the answers of their calls.
struct Candidates {
    image: Photo,
    candidates: Vec<Candidate>,
    next: Next,
    options: ImageOptions,
}

impl Finish for Candidates {
    fn output(self: Box<Self>, answers: Vec<Vec<OutputTensor>>) -> Result<Step, Failure> {
        let network = self.next.network();
        let want = match self.next {
            Next::Refine => RNET_OUTPUTS.len(),
            Next::Output => ONET_OUTPUTS.len(),
        };
        // The calls' rows, joined back in the order the candidates were sent.
        let mut joined: Vec<Vec<f32>> = vec![Vec::new(); want];
        for answer in &answers {
            if answer.len() != want {
                return Err(internal(format!("{network} answered {} outputs; it gives {want}", answer.len())));
            }
            for (all, tensor) in joined.iter_mut().zip(answer) {
                all.extend_from_slice(&tensor.floats()?);
            }
        }
        match self.next {
            Next::Refine => {
                let answer = StageAnswer { offsets: &joined[0], probs: &joined[1], landmarks: None };
                let refined = mtcnn::refine(&self.candidates, &answer, self.options.thresholds[1])?;
                next_stage(self.image, refined, Next::Output, self.options)
            }
            Next::Output => {
                let answer = StageAnswer { offsets: &joined[0], landmarks: Some(&joined[1]), probs: &joined[2] };
                let faces = mtcnn::finish(&self.candidates, &answer, self.options.thresholds[2])?;
                Ok(self.image.result(faces, self.options.max_faces))
            }
        }
    }

    fn cpu_bound(&self) -> bool {
        true
    }

    fn held_bytes(&self) -> u64 {
        self.image.bytes()
    }
}

fn internal(message: String) -> Failure {
    Failure::new(ErrorKind::Internal, Stage::Postprocess, message)
}
