export function mountModels(section) {
  return {};
}
