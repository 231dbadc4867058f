//! `mask_png`: a model's `[h, w]` map (`[1, h, w]`, `[1, 1, h, w]`) as a PNG of the input
//! image's size. The map covers the model input; each image pixel's centre is carried into the
//! model input through the image converter's placement (`model = image · scale + pad`, which
//! undoes the resize, letterbox or crop), then into the map by the map's share of the model
//! input, and takes that map cell (nearest). Image pixels the model input does not cover (cut
//! off by a crop) are background. Without a placement (not an image converter) the PNG is the
//! map's own size.
//!
//! A yes/no map (probabilities thresholded, or BOOL) is an 8-bit greyscale PNG of 0 and 255;
//! class labels are the indices of a palette PNG (at most 256 classes), with PASCAL VOC's
//! colours, so label 0 (background) is black.

use super::image::Placement;

/// A map's cells.
pub enum Map {
    /// Yes (255) or no (0).
    Binary(Vec<bool>),
    /// A class index per cell.
    Labels(Vec<u8>),
}

impl Map {
    fn len(&self) -> usize {
        match self {
            Map::Binary(v) => v.len(),
            Map::Labels(v) => v.len(),
        }
    }

    fn at(&self, i: usize) -> u8 {
        match self {
            Map::Binary(v) => u8::from(v[i]) * 255,
            Map::Labels(v) => v[i],
        }
    }
}

/// The map's height and width from its shape: `[h, w]` with any leading 1s.
pub fn map_size(shape: &[usize]) -> Result<(usize, usize), String> {
    let (lead, hw) = shape.split_at(shape.len().saturating_sub(2));
    if hw.len() != 2 || lead.iter().any(|&d| d != 1) || hw.contains(&0) {
        return Err(format!("mask_png takes a [h, w] map (or [1, h, w], [1, 1, h, w]), got shape {shape:?}"));
    }
    Ok((hw[0], hw[1]))
}

/// The PNG, with its width and height.
pub fn render(map: &Map, shape: &[usize], frame: Option<(&Placement, (u32, u32))>) -> Result<(Vec<u8>, u32, u32), String> {
    let (h, w) = map_size(shape)?;
    if map.len() != h * w {
        return Err(format!("a map of shape {shape:?} with {} values", map.len()));
    }
    let (width, height, pixels) = match frame {
        None => (w as u32, h as u32, (0..h * w).map(|i| map.at(i)).collect::<Vec<u8>>()),
        Some((placement, (model_w, model_h))) => {
            let (iw, ih) = (placement.width, placement.height);
            let (to_u, to_v) = (w as f64 / f64::from(model_w.max(1)), h as f64 / f64::from(model_h.max(1)));
            // Each column's and each row's map cell, once.
            let column = |x: u32| {
                let m = (f64::from(x) + 0.5) * f64::from(placement.scale_x) + f64::from(placement.pad_x);
                let u = (m * to_u).floor();
                (u >= 0.0 && u < w as f64).then_some(u as usize)
            };
            let row = |y: u32| {
                let m = (f64::from(y) + 0.5) * f64::from(placement.scale_y) + f64::from(placement.pad_y);
                let v = (m * to_v).floor();
                (v >= 0.0 && v < h as f64).then_some(v as usize)
            };
            let columns: Vec<Option<usize>> = (0..iw).map(column).collect();
            let mut pixels = Vec::with_capacity(iw as usize * ih as usize);
            for y in 0..ih {
                let v = row(y);
                pixels.extend(columns.iter().map(|u| match (u, v) {
                    (Some(u), Some(v)) => map.at(v * w + u),
                    _ => 0,
                }));
            }
            (iw, ih, pixels)
        }
    };
    let png = encode(width, height, &pixels, matches!(map, Map::Labels(_)))?;
    Ok((png, width, height))
}

/// An 8-bit PNG: greyscale, or palette indices with VOC's colours.
fn encode(width: u32, height: u32, pixels: &[u8], palette_image: bool) -> Result<Vec<u8>, String> {
    let mut png = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut png, width, height);
        encoder.set_depth(png::BitDepth::Eight);
        if palette_image {
            encoder.set_color(png::ColorType::Indexed);
            encoder.set_palette(palette());
        } else {
            encoder.set_color(png::ColorType::Grayscale);
        }
        let mut writer = encoder.write_header().map_err(|e| format!("writing the PNG: {e}"))?;
        writer.write_image_data(pixels).map_err(|e| format!("writing the PNG: {e}"))?;
    }
    Ok(png)
}

/// A picture-sized mask that crops' maps are pasted into (a pipeline's map stage): each crop's
/// map covers its own rectangle of the picture, through that crop's placement (`model =
/// picture · scale + pad`); a pixel is foreground when any crop says so, and a class label
/// is the last nonzero one pasted over it.
pub struct Canvas {
    width: u32,
    height: u32,
    pixels: Vec<u8>,
    labels: bool,
}

impl Canvas {
    /// An empty (background) mask of the picture's size.
    pub fn new(width: u32, height: u32) -> Self {
        Canvas { width, height, pixels: vec![0; width as usize * height as usize], labels: false }
    }

    /// Pastes `map` (of `shape`, covering a `model_w × model_h` model input) over the picture
    /// rectangle `rect` (`[x0, y0, x1, y1)`, in pixels) it was cropped from.
    pub fn paste(&mut self, map: &Map, shape: &[usize], placement: &Placement, (model_w, model_h): (u32, u32), rect: [u32; 4]) -> Result<(), String> {
        let (h, w) = map_size(shape)?;
        if map.len() != h * w {
            return Err(format!("a map of shape {shape:?} with {} values", map.len()));
        }
        self.labels |= matches!(map, Map::Labels(_));
        let (to_u, to_v) = (w as f64 / f64::from(model_w.max(1)), h as f64 / f64::from(model_h.max(1)));
        let cell = |i: u32, scale: f32, pad: f32, to: f64, n: usize| {
            let m = (f64::from(i) + 0.5) * f64::from(scale) + f64::from(pad);
            let c = (m * to).floor();
            (c >= 0.0 && c < n as f64).then_some(c as usize)
        };
        let [x0, y0, x1, y1] = [rect[0].min(self.width), rect[1].min(self.height), rect[2].min(self.width), rect[3].min(self.height)];
        let columns: Vec<Option<usize>> = (x0..x1).map(|x| cell(x, placement.scale_x, placement.pad_x, to_u, w)).collect();
        for y in y0..y1 {
            let Some(v) = cell(y, placement.scale_y, placement.pad_y, to_v, h) else { continue };
            let row = &mut self.pixels[y as usize * self.width as usize..][..self.width as usize];
            for (x, u) in (x0..x1).zip(&columns) {
                let Some(u) = u else { continue };
                let value = map.at(v * w + u);
                if value != 0 {
                    row[x as usize] = value;
                }
            }
        }
        Ok(())
    }

    /// The mask as a PNG, with its width and height.
    pub fn png(&self) -> Result<(Vec<u8>, u32, u32), String> {
        Ok((encode(self.width, self.height, &self.pixels, self.labels)?, self.width, self.height))
    }
}

/// PASCAL VOC's 256 colours: label `i`'s bits spread over the high bits of R, G and B.
fn palette() -> Vec<u8> {
    let mut colours = Vec::with_capacity(256 * 3);
    for label in 0..256u32 {
        let (mut r, mut g, mut b, mut c) = (0u8, 0u8, 0u8, label);
        for shift in (0..8).rev() {
            r |= ((c & 1) as u8) << shift;
            g |= (((c >> 1) & 1) as u8) << shift;
            b |= (((c >> 2) & 1) as u8) << shift;
            c >>= 3;
        }
        colours.extend([r, g, b]);
    }
    colours
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(png: &[u8]) -> (png::OutputInfo, Vec<u8>, Option<Vec<u8>>) {
        let decoder = png::Decoder::new(std::io::Cursor::new(png));
        let mut reader = decoder.read_info().expect("a png");
        let mut buf = vec![0; reader.output_buffer_size().expect("size")];
        let info = reader.next_frame(&mut buf).expect("a frame");
        let palette = reader.info().palette.as_ref().map(|p| p.to_vec());
        buf.truncate(info.buffer_size());
        (info, buf, palette)
    }

    #[test]
    fn a_map_the_size_of_a_stretched_image_comes_back_at_the_image_size() {
        // A 4x2 image stretched to a 2x2 model input; the map is the model input's size.
        let placement = Placement { scale_x: 0.5, scale_y: 1.0, pad_x: 0.0, pad_y: 0.0, width: 4, height: 2 };
        let map = Map::Binary(vec![true, false, false, true]);
        let (png, w, h) = render(&map, &[1, 2, 2], Some((&placement, (2, 2)))).expect("renders");
        assert_eq!((w, h), (4, 2));
        let (info, pixels, _) = decode(&png);
        assert_eq!((info.width, info.height), (4, 2));
        assert_eq!(pixels, vec![255, 255, 0, 0, 0, 0, 255, 255]);
    }

    #[test]
    fn letterbox_padding_is_left_out_and_a_crop_leaves_background() {
        // A 2x1 image letterboxed into a 2x2 model input: it sits in the top... middle row band.
        // model = image * 1 + (0, 0.5): the image's row covers model rows 0.5..1.5, its centre 1.0.
        let placement = Placement { scale_x: 1.0, scale_y: 1.0, pad_x: 0.0, pad_y: 0.5, width: 2, height: 1 };
        let map = Map::Binary(vec![false, false, true, false]);
        let (png, ..) = render(&map, &[2, 2], Some((&placement, (2, 2)))).expect("renders");
        assert_eq!(decode(&png).1, vec![255, 0]);
        // A 4x1 image cropped to its middle two columns: the outer columns are background.
        let crop = Placement { scale_x: 1.0, scale_y: 1.0, pad_x: -1.0, pad_y: 0.0, width: 4, height: 1 };
        let (png, ..) = render(&Map::Binary(vec![true, true]), &[1, 2], Some((&crop, (2, 1)))).expect("renders");
        assert_eq!(decode(&png).1, vec![0, 255, 255, 0]);
    }

    #[test]
    fn labels_are_a_palette_image_and_bad_shapes_are_refused() {
        let (png, w, h) = render(&Map::Labels(vec![0, 1, 2, 15]), &[2, 2], None).expect("renders");
        assert_eq!((w, h), (2, 2));
        let (info, pixels, palette) = decode(&png);
        assert_eq!(info.color_type, png::ColorType::Indexed);
        assert_eq!(pixels, vec![0, 1, 2, 15]);
        let palette = palette.expect("a palette");
        assert_eq!(&palette[..6], &[0, 0, 0, 128, 0, 0], "VOC: background black, class 1 dark red");
        for bad in [vec![2, 2, 2], vec![4], vec![0, 3]] {
            assert!(render(&Map::Binary(vec![false; 8]), &bad, None).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn crops_paste_into_their_rectangles_of_one_mask() {
        // A 6x2 picture; a crop of its columns 1..3 stretched to a 4x2 model input (scale 2),
        // and one of columns 4..6 at its own size.
        let mut canvas = Canvas::new(6, 2);
        let left = Placement { scale_x: 2.0, scale_y: 1.0, pad_x: -2.0, pad_y: 0.0, width: 6, height: 2 };
        canvas.paste(&Map::Binary(vec![true, true, false, false, false, false, true, true]), &[2, 4], &left, (4, 2), [1, 0, 3, 2]).expect("pastes");
        let right = Placement { scale_x: 1.0, scale_y: 1.0, pad_x: -4.0, pad_y: 0.0, width: 6, height: 2 };
        canvas.paste(&Map::Binary(vec![false, true, false, false]), &[1, 2, 2], &right, (2, 2), [4, 0, 6, 2]).expect("pastes");
        let (png, w, h) = canvas.png().expect("encodes");
        assert_eq!((w, h), (6, 2));
        assert_eq!(decode(&png).1, vec![0, 255, 0, 0, 0, 255, 0, 0, 255, 0, 0, 0]);
        assert!(canvas.paste(&Map::Binary(vec![true; 3]), &[2, 2], &left, (4, 2), [0, 0, 1, 1]).is_err());
    }
}
